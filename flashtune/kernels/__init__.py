"""Triton FlashAttention-2 kernels, host launchers, autograd/custom-op wrappers, reference."""

from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    check_bwd,
    check_fwd,
    default_bwd,
    default_fwd,
)

__all__ = ["FwdConfig", "BwdConfig", "check_fwd", "check_bwd", "default_fwd", "default_bwd"]
