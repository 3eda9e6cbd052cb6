"""The autotuner: search spaces, Optuna search, measurement, correctness gate.

``tune(problem, direction=..., trials=..., storage=...)`` is the entry point; see its
docstring. Importing this package imports Optuna; the dispatch path never does.
"""

from __future__ import annotations

from flashtune.autotune.space import SearchSpace
from flashtune.autotune.tuner import TuneResult, TuneSession, study_name, tune

__all__ = ["SearchSpace", "TuneResult", "TuneSession", "study_name", "tune"]
