"""PyTorch SDPA's signature and PyTorch's flash-attention registry.

:func:`scaled_dot_product_attention` takes ``F.scaled_dot_product_attention``'s arguments
and layout, (B, H, S, D). Calls flashtune can serve run flashtune's kernels (through
the dispatcher); the rest run torch's SDPA, with one WARNING per reason per process.

Where the installed torch has ``torch.nn.attention.register_flash_attention_impl``
(2.13 and later), importing this module registers flashtune under the name
``"flashtune"``; then::

    import flashtune.sdpa
    torch.nn.attention.activate_flash_attention_impl("flashtune")

makes ``F.scaled_dot_product_attention``'s flash backend run flashtune, forward and
backward, until ``torch.nn.attention.restore_flash_attention_impl()``. torch decides
when its flash backend runs (no mask; fp16/bf16). flashtune then serves what it can
and raises a RuntimeError naming what it cannot (dropout, causal with seqlen_q !=
seqlen_k), as torch's own FA4 registration does. On a CPU under Triton's interpreter
the registration covers torch's CPU flash kernel, so CI tests this path.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import flashtune.dispatch
from flashtune.kernels.attention import _INTERPRET, _bwd_impl, _fwd_impl, flash_attention
from flashtune.problem import HEAD_DIMS, default_scale, head_dim_ok

log = logging.getLogger(__name__)

NAME = "flashtune"
_warned: set[str] = set()
# Calls flashtune served, by path: the public function ("sdpa") and the registered torch
# ops ("torch_fwd", "torch_bwd"). Tests read it to tell the kernels from the fallback.
calls = {"sdpa": 0, "fallback": 0, "torch_fwd": 0, "torch_bwd": 0}


def _fallback_reason(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
                     is_causal: bool, enable_gqa: bool) -> str | None:
    """Why flashtune cannot serve this SDPA call (None: it can)."""
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return "non-tensor inputs"
    if attn_mask is not None:
        return "an attn_mask"
    if dropout_p > 0.0:
        return "dropout_p > 0"
    if any(t.dim() != 4 for t in ts):
        return "inputs that are not 4-D (B, H, S, D)"
    if query.dtype not in (torch.float16, torch.bfloat16) or not (
            query.dtype == key.dtype == value.dtype):
        return f"dtype {query.dtype} (flashtune runs fp16 and bf16)"
    d = query.shape[-1]
    if key.shape[-1] != d or value.shape[-1] != d:
        return "a value head dim that differs from the query's"
    if not head_dim_ok(d):
        return f"head_dim {d} (flashtune runs {HEAD_DIMS})"
    if query.device.type != "cuda" and not (query.device.type == "cpu" and _INTERPRET):
        return f"device {query.device.type}"
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk and not (enable_gqa and hk >= 1 and hq % hk == 0):
        return "head counts that differ without enable_gqa"
    if is_causal and query.shape[2] < key.shape[2]:
        return "is_causal with seqlen_q < seqlen_k (SDPA aligns it top-left)"
    if query.shape[2] < 1 or key.shape[2] < 1 or query.shape[0] < 1:
        return "an empty batch or sequence"
    return None


def _warn_once(reason: str) -> None:
    if reason not in _warned and not torch.compiler.is_compiling():
        _warned.add(reason)
        log.warning("flashtune.scaled_dot_product_attention: running torch's SDPA for %s",
                    reason)


def _causal_window(is_causal: bool, sq: int, sk: int) -> tuple[bool, tuple[int, int]]:
    """SDPA's causal mask is top-left aligned; flashtune's bottom-right. Equal lengths agree;
    with seqlen_q > seqlen_k, row i sees keys j <= i: a right window of Sq - Sk."""
    if not is_causal or sq == sk:
        return is_causal, (-1, -1)
    return False, (-1, sq - sk)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, served by flashtune where it can:
    4-D (B, H, S, D) fp16/bf16 inputs, no ``attn_mask``, no dropout, GQA with
    ``enable_gqa=True``, ``is_causal`` top-left aligned as SDPA's is. Anything else runs
    torch's SDPA (one WARNING per reason per process) and gives torch's result or error."""
    why = _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if why is not None:
        _warn_once(why)
        calls["fallback"] += 1
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    causal, window = _causal_window(is_causal, query.shape[2], key.shape[2])
    calls["sdpa"] += 1
    out = flash_attention(query, key, value, causal=causal, softmax_scale=scale,
                          window_size=window)
    assert isinstance(out, torch.Tensor)
    return out


# ----------------------------------------------------------------------------- torch's registry


def _op_args(q: torch.Tensor, k: torch.Tensor, dropout_p: float, is_causal: bool,
             scale: float | None) -> tuple[bool, float, tuple[int, int]]:
    if q.dtype not in (torch.float16, torch.bfloat16):  # torch's CPU flash kernel takes fp32
        raise RuntimeError(f"flashtune flash attention: dtype {q.dtype} is not supported")
    if dropout_p > 0.0:
        raise RuntimeError(f"flashtune flash attention: dropout_p={dropout_p} is not supported")
    if is_causal and q.shape[2] != k.shape[2]:
        raise RuntimeError("flashtune flash attention: is_causal with seqlen_q != seqlen_k "
                           f"({q.shape[2]} vs {k.shape[2]}) is not supported")
    d = q.shape[-1]
    if not head_dim_ok(d) or k.shape[-1] != d:
        raise RuntimeError(f"flashtune flash attention: head_dim {d} is not supported")
    return is_causal, scale if scale is not None else default_scale(d), (-1, -1)


def _flash_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False,
               *, scale: float | None = None) -> tuple[Any, ...]:
    """``aten::_scaled_dot_product_flash_attention`` (CUDA)."""
    causal, sc, window = _op_args(query, key, dropout_p, is_causal, scale)
    calls["torch_fwd"] += 1
    out, lse = _fwd_impl(query, key, value, causal, sc, window, 0.0, [])
    dev = query.device
    return (out, lse, None, None, query.shape[2], key.shape[2],
            torch.zeros((2,), dtype=torch.uint64, device=dev),
            torch.zeros((), dtype=torch.uint64, device=dev),
            torch.empty(0, dtype=query.dtype, device=dev))


def _flash_bwd(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: Any,
               cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
               philox_seed: Any, philox_offset: Any, *, scale: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::_scaled_dot_product_flash_attention_backward`` (CUDA)."""
    causal, sc, window = _op_args(query, key, dropout_p, is_causal, scale)
    calls["torch_bwd"] += 1
    return _bwd_impl(grad_out, query, key, value, out, logsumexp, causal, sc, window, 0.0, [])


def _cpu_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             dropout_p: float = 0.0, is_causal: bool = False, *,
             attn_mask: torch.Tensor | None = None, scale: float | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_scaled_dot_product_flash_attention_for_cpu`` (interpreter only)."""
    if attn_mask is not None:
        raise RuntimeError("flashtune flash attention: attn_mask is not supported")
    causal, sc, window = _op_args(query, key, dropout_p, is_causal, scale)
    calls["torch_fwd"] += 1
    return _fwd_impl(query, key, value, causal, sc, window, 0.0, [])


def _cpu_bwd(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float,
             is_causal: bool, *, attn_mask: torch.Tensor | None = None,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::_scaled_dot_product_flash_attention_for_cpu_backward`` (interpreter only)."""
    causal, sc, window = _op_args(query, key, dropout_p, is_causal, scale)
    calls["torch_bwd"] += 1
    return _bwd_impl(grad_out, query, key, value, out, logsumexp, causal, sc, window, 0.0, [])


@dataclass
class _Handle:
    """What ``activate_flash_attention_impl`` keeps alive; dropping the library on
    ``remove()`` takes flashtune's kernels out of torch's dispatcher again."""

    library: Any

    def remove(self) -> None:
        self.library = None


def _activate() -> _Handle:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # overriding torch's kernel is the point: no warning
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        lib.impl("_scaled_dot_product_flash_attention", _flash_fwd, "CUDA")
        lib.impl("_scaled_dot_product_flash_attention_backward", _flash_bwd, "CUDA")
        if _INTERPRET:
            lib.impl("_scaled_dot_product_flash_attention_for_cpu", _cpu_fwd, "CPU")
            lib.impl("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_bwd, "CPU")
    return _Handle(lib)


def register_with_torch() -> bool:
    """Register ``"flashtune"`` with torch's flash-attention registry (done on import).
    False where the installed torch has no registry (before 2.13)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=_activate)
    return True


flashtune.dispatch.install()  # the calls flashtune serves get the tuned configs
register_with_torch()
