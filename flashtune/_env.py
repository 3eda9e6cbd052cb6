"""One parse of each environment variable flashtune reads, and the dtype map.

Every function reads the environment when called (tests and the CLI set variables at
run time); nothing here imports torch or triton at module level.

- ``TRITON_INTERPRET``: :func:`interpreting`, by Triton's own rule ("1", "true" or
  "on", any case), so flashtune and Triton always agree on whether the interpreter runs.
- ``FLASHTUNE_DB``: :func:`database_url` (None when unset or empty).
- ``FLASHTUNE_STRICT``, ``FLASHTUNE_TUNE_ON_MISS``, ``FLASHTUNE_DIST_SYNC``,
  ``FLASHTUNE_UNVERIFIED_KNOBS`` (``kernels.config.REFUSED_KNOBS``): :func:`flag`.
- ``FLASHTUNE_TUNE_TRIALS``, ``FLASHTUNE_DIST_TIMEOUT``, ``FLASHTUNE_SIGNAL_GRACE``:
  :func:`number`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

INTERPRET = "TRITON_INTERPRET"
DTYPE_NAMES = ("fp16", "bf16")


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET``, Triton's rule)."""
    return os.environ.get(INTERPRET, "0").strip().lower() in ("1", "true", "on")


def flag(name: str) -> bool:
    """A FLASHTUNE_* switch: off when unset, empty, "0", "false", "no" or "off"."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def is_set(name: str) -> bool:
    return name in os.environ


def number(name: str, default: float) -> float:
    """A numeric FLASHTUNE_* setting; ``default`` when unset or not a number."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def database_url() -> str | None:
    """``FLASHTUNE_DB``, or None when it is unset or empty."""
    return os.environ.get("FLASHTUNE_DB") or None


def cache_home() -> str:
    """``XDG_CACHE_HOME``, or ``~/.cache``."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


@contextlib.contextmanager
def setenv(name: str, value: str | None) -> Iterator[None]:
    """Set ``name`` to ``value`` for the block (None: leave it as it is)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name ("fp16" or "bf16")."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def dtype_name(dtype: Any) -> str:
    """The dtype name ("fp16" or "bf16") of a torch dtype; KeyError for any other."""
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
