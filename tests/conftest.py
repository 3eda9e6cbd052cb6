"""Shared fixtures. Without a CUDA GPU, kernels run under Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Must be set before any @triton.jit is evaluated (i.e. before flashtune.kernels loads).
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
