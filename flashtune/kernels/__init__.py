"""Triton FlashAttention-2 kernels, host launchers, autograd/custom-op wrappers, reference."""

from flashtune.kernels._interp_compat import patch_interpreter_bf16_dot
from flashtune.kernels.config import (
    BwdConfig,
    FwdConfig,
    check_bwd,
    check_fwd,
    default_bwd,
    default_fwd,
)

patch_interpreter_bf16_dot()

__all__ = ["FwdConfig", "BwdConfig", "check_fwd", "check_bwd", "default_fwd", "default_bwd"]
