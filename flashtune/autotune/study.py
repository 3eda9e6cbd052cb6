"""The one adapter over Optuna: storages, samplers, study names, and the calls into
Optuna's private API, all confined here.

A study is one per (device, software, problem, direction). It lives in the tuning
database (Optuna's RDB storage, same URL) under a name built from the fingerprints and
the problem, so a second ``tune()`` of the same problem resumes it.
"""

from __future__ import annotations

import socket
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from flashtune._host import pid_alive
from flashtune.autotune.space import SearchSpace
from flashtune.problem import Problem

SAMPLERS = ("tpe", "random", "grid")
_MEMORY_STUDIES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# Messages of the errors a process gets when another one is creating Optuna's tables in the
# same new database at the same moment (SQLite and PostgreSQL wordings).
_CREATION_RACE = ("already exists", "unique constraint", "duplicate key", "database is locked",
                  "deadlock detected")


def problem_slug(p: Problem) -> str:
    s = (f"b{p.batch}h{p.heads_q}kv{p.heads_kv}q{p.seqlen_q}k{p.seqlen_k}d{p.head_dim}"
         f"{p.dtype}")
    if p.causal:
        s += "c"
    if p.has_window:
        s += f"w{p.window[0]}_{p.window[1]}"
    if p.softcap > 0:
        s += f"cap{p.softcap:g}"
    return s


def study_name(device_fp: str, software_fp: str, problem: Problem, direction: str,
               space: SearchSpace, sampler: str) -> str:
    """The study's name: one per (device, software, problem, direction), plus the space
    and sampler when they are not the defaults (their trials must not mix)."""
    name = f"flashtune/{direction}/{device_fp}/{software_fp}/{problem_slug(problem)}"
    if not space.is_full:
        name += f"/space-{space.signature}"
    if sampler != "tpe":
        name += f"/{sampler}"
    return name


def optuna_storage(url: str, owner: Any = None, *, create: bool = True) -> Any:
    """Optuna's storage for our database URL: RDB storage on the same database, or, for an
    in-memory SQLite database, an in-memory Optuna storage that lives as long as
    ``owner`` (our storage object: each in-memory database has its own studies).
    ``create=False``: a missing SQLite file raises DatabaseMissingError (it was deleted
    since our own storage opened it) instead of being made again, empty."""
    import optuna

    if url in ("sqlite://", "sqlite:///:memory:") or url.endswith(":memory:"):
        if owner is None:
            return optuna.storages.InMemoryStorage()
        try:
            return _MEMORY_STUDIES.setdefault(owner, optuna.storages.InMemoryStorage())
        except TypeError:  # not weak-referenceable
            return optuna.storages.InMemoryStorage()
    return _rdb_storage(url, create=create)


def _rdb_storage(url: str, attempts: int = 8, *, create: bool = True) -> Any:
    """Optuna's RDB storage, created race-free. Optuna creates its tables and stamps their
    version on first use without a lock, so processes that open one new database together
    collide ("table studies already exists", a duplicate version row). The loser retries
    and finds the tables made; any other error is raised at once."""
    import optuna
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    from flashtune.db.rdb import rw_uri
    from flashtune.exceptions import DatabaseMissingError

    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:") \
            and not str(u.database).startswith("file:"):
        path = Path(str(u.database))
        if not create and not path.is_file():
            raise DatabaseMissingError(f"{path}: the database file was deleted or replaced "
                                       "while in use; nothing more is written")
        if not create or path.is_file():
            # Never create the file again once it exists (our own engine does the same).
            url = f"sqlite:///{rw_uri(path)}&uri=true"
    for i in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError,
                sqlalchemy.exc.ProgrammingError) as e:
            if i == attempts - 1 or not any(m in str(e).lower() for m in _CREATION_RACE):
                raise
            time.sleep(0.05 * 2 ** i)
    raise AssertionError("unreachable")


def make_sampler(kind: str, seed: int, n_startup: int, parallel: bool) -> Any:
    import optuna

    if kind == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                              constant_liar=parallel,
                                              n_startup_trials=n_startup)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "grid":
        # Every point is enqueued by the tuner (Optuna's GridSampler stops the study from
        # inside tell(), which only works under study.optimize).
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {kind!r}")


def open_study(name: str, url: str, owner: Any, sampler: Any, attrs: dict[str, Any]) -> Any:
    """Create or load the study ``name``; a new one gets ``attrs`` as its user attributes."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Our storage ``owner`` made the database already: Optuna must never make it again.
    study = optuna.create_study(study_name=name, storage=optuna_storage(url, owner,
                                                                        create=False),
                                sampler=sampler, direction="minimize", load_if_exists=True)
    if "problem" not in study.user_attrs:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
    recover(study)
    return study


def proposer(record: Any, sampler: Any) -> Any:
    """The sampler's own study, in memory, beside the database's study ``record``.

    The sampler proposes here, and the warm-start seeds and the grid are enqueued here.
    Most of a sampler's picks in the full space are infeasible or were measured already:
    answered in memory, they cost the sampler's time only, where a trial of an RDB study
    costs a transaction per parameter and attribute. A candidate reaches ``record`` once,
    with its outcome (:func:`record_trial`). The proposer starts from ``record``'s finished
    trials, so a resumed search's sampler knows what ran. ``sampler`` None: random."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                sampler=sampler or optuna.samplers.RandomSampler(),
                                direction="minimize")
    study.add_trials(record.get_trials(deepcopy=False,
                                       states=(TrialState.COMPLETE, TrialState.PRUNED)))
    return study


def record_trial(study: Any, cand: Any, space: SearchSpace, state: Any,
                 value: float | None = None) -> Any:
    """Write a finished candidate (its params, attributes and outcome; see
    :class:`flashtune.autotune.search.Candidate`) into ``study`` as one trial, in one
    transaction; returns the stored trial, numbered by the study."""
    import datetime

    from optuna.distributions import CategoricalDistribution
    from optuna.trial import FrozenTrial

    fields = space.fields
    frozen = FrozenTrial(
        number=0, state=state, value=value, datetime_start=cand.started,
        datetime_complete=datetime.datetime.now(), params=dict(cand.params),
        distributions={n: CategoricalDistribution(list(fields[n])) for n in cand.params},
        user_attrs=dict(cand.user_attrs), system_attrs={}, intermediate_values={},
        trial_id=0)
    storage = study._storage
    return storage.get_trial(storage.create_new_trial(study._study_id, template_trial=frozen))


_TUNER = "tuner:"  # study attribute prefix: one entry per tuner process that used the study


def recover(study: Any) -> int:
    """Fail trials left RUNNING by a tuner on this host that no longer exists (kill -9),
    then register this process as one of the study's tuners.

    A trial is asked (made RUNNING) before its tuner's pid can be written to it, so a kill
    in between leaves a RUNNING trial with no pid. Such a trial is abandoned too when every
    tuner that ever used the study ran on this host and none of them is alive."""
    import os

    from optuna.trial import TrialState

    host, me, n = socket.gethostname(), os.getpid(), 0
    tuners = [k[len(_TUNER):].rsplit(":", 1) for k in study.user_attrs if k.startswith(_TUNER)]
    nobody_else = all(h == host and (int(pid) == me or not pid_alive(int(pid)))
                      for h, pid in tuners)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if (t.user_attrs.get("host") == host and pid and not pid_alive(int(pid))) \
                or (pid is None and nobody_else):
            study._storage.set_trial_user_attr(t._trial_id, "error",
                                               "abandoned: the tuner process died")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    study.set_user_attr(f"{_TUNER}{host}:{me}", time.time())
    return n
