"""flashtune: autotuned Triton FlashAttention-2 kernels, a tuning database and a dispatcher.

Public API: :func:`flash_attention`, :func:`explain`, :data:`__version__`.
Importing flashtune does not import optuna or sqlalchemy; they load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["flash_attention", "explain", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import flashtune` stays cheap (no triton compile, no database engine).
    if name == "flash_attention":
        from flashtune.kernels.attention import flash_attention

        return flash_attention
    if name == "explain":
        from flashtune.dispatch import explain

        return explain
    raise AttributeError(f"module 'flashtune' has no attribute {name!r}")
