"""Shared fixtures. Without a CUDA GPU, kernels run under Triton's CPU interpreter."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Must be set before any @triton.jit is evaluated (i.e. before flashtune.kernels loads).
    os.environ.setdefault("TRITON_INTERPRET", "1")


_HOME = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The suite never reads or writes the user's tuning database: FLASHTUNE_DB is unset
    and the default location (platformdirs' data folder, the legacy cache folder) lies in a
    folder of this run, removed at the end. Subprocesses inherit it. Otherwise dispatcher
    misses of one run land in the real database and a second run starts from them."""
    home = tempfile.mkdtemp(prefix="flashtune-test-home-")
    config.stash[_HOME] = home
    os.environ.pop("FLASHTUNE_DB", None)
    os.environ["XDG_DATA_HOME"] = os.path.join(home, "data")
    os.environ["XDG_CACHE_HOME"] = os.path.join(home, "cache")


def pytest_unconfigure(config: pytest.Config) -> None:
    home = config.stash.get(_HOME, None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_pg = pytest.mark.skip(reason="needs FLASHTUNE_TEST_PG_URL (the server .ci/run starts)")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "postgres" in item.keywords and not os.environ.get("FLASHTUNE_TEST_PG_URL"):
            item.add_marker(skip_pg)


@pytest.fixture
def device() -> str:
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run, printed on failure so a case can be replayed."""
    s = int.from_bytes(os.urandom(4), "little") if "FLASHTUNE_SEED" not in os.environ \
        else int(os.environ["FLASHTUNE_SEED"])
    torch.manual_seed(s)
    return s


@pytest.fixture(autouse=True)
def _no_stray_misses() -> None:
    """Drop the dispatcher's pending misses before each test. Misses recorded by earlier
    tests are written by a background thread, when it wakes, to whatever database
    ``FLASHTUNE_DB`` then names: a later test's database under test gained rows it never
    made (``test_corrupt_every_cell`` failed so when tests/kernels ran first)."""
    from flashtune.dispatch import _misses

    with _misses.recorder._writing:  # a write in flight finishes first
        _misses.recorder._take()


@pytest.fixture(autouse=True)
def _gpu_memory_back() -> Iterator[None]:
    """Give the caching allocator's free blocks back to the GPU after each test: under
    pytest-xdist several processes share one GPU, and a process that once held an S=16k
    reference (tens of GiB) would otherwise keep it from the others for the whole run."""
    yield
    if _HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
