"""flashtune: autotuned Triton FlashAttention-2 kernels, a tuning database and a dispatcher.

Public API: :func:`flash_attention`, :func:`explain`, :data:`__version__`.
Importing flashtune does not import triton, optuna or sqlalchemy; ``flash_attention``
loads the kernels and installs the dispatcher (:mod:`flashtune.dispatch`) on first use,
and the dispatcher opens the tuning database on its first call.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["flash_attention", "explain", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import flashtune` stays cheap (no triton compile, no database engine).
    if name == "flash_attention":
        import flashtune.dispatch  # noqa: F401  (installs the tuned-config resolver)
        from flashtune.kernels.attention import flash_attention

        globals()["flash_attention"] = flash_attention  # later lookups skip __getattr__
        return flash_attention
    if name == "explain":
        from flashtune.dispatch import explain

        globals()["explain"] = explain
        return explain
    raise AttributeError(f"module 'flashtune' has no attribute {name!r}")
