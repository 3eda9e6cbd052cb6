"""flashtune: autotuned Triton FlashAttention-2 kernels, a tuning database and a dispatcher.

Public API: :func:`flash_attention` (PyTorch's (B, H, S, D) layout), :func:`flash_attn_func`
(flash-attn's (B, S, H, D)), :func:`flash_attn_varlen_func` (packed (total, H, D)),
:func:`scaled_dot_product_attention` (SDPA's signature, falls back to torch),
:func:`explain`, :class:`FwdConfig`, :class:`BwdConfig` (for ``config=``), :class:`Problem`
(for ``tune()``) and :data:`__version__`.
Importing flashtune does not import triton, optuna or sqlalchemy; ``flash_attention``
(and every other name served by the dispatcher) loads the kernels and installs the
dispatcher (:func:`flashtune.dispatch.install`) on first use, and the dispatcher opens
the tuning database on its first call.
"""

from __future__ import annotations

import importlib
from typing import Any

from flashtune._version import __version__

__all__ = ["flash_attention", "flash_attn_func", "flash_attn_varlen_func",
           "scaled_dot_product_attention", "explain", "FwdConfig", "BwdConfig", "Problem",
           "__version__"]

# name -> (module, attribute); loaded on first use so that `import flashtune` stays cheap.
_LAZY = {
    "flash_attention": ("flashtune.dispatch", "flash_attention"),
    "flash_attn_func": ("flashtune.dispatch", "flash_attn_func"),
    "flash_attn_varlen_func": ("flashtune.dispatch", "flash_attn_varlen_func"),
    "scaled_dot_product_attention": ("flashtune.sdpa", "scaled_dot_product_attention"),
    "explain": ("flashtune.dispatch", "explain"),
    "FwdConfig": ("flashtune.kernels.config", "FwdConfig"),
    "BwdConfig": ("flashtune.kernels.config", "BwdConfig"),
    "Problem": ("flashtune.problem", "Problem"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'flashtune' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    if module in ("flashtune.dispatch", "flashtune.sdpa"):
        importlib.import_module("flashtune.dispatch").install()  # the tuned configs
    value = getattr(mod, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
