"""``attn_implementation="flashtune"`` for Hugging Face transformers models.

::

    import flashtune.integrations.transformers as ft_hf
    ft_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashtune")

Registers :func:`attention_forward` with transformers' ``AttentionInterface`` and, where
the installed transformers has one, the FA2-style mask with ``AttentionMaskInterface``
(no mask unless there is padding). Llama-family models then run flashtune's kernels
with the tuned config: GQA without repeating K/V, causal, the model's sliding window
(``sliding_window=W`` sees W keys including itself: ``window_size=(W-1, 0)``) and
logit softcapping. Calls the kernels cannot serve exactly (padding masks, packed
sequences, attention dropout, fp32 models, unsupported head dims) run through
PyTorch's SDPA instead, with the same semantics, and say so once in the log.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import torch
import torch.nn.functional as F

from flashtune.problem import default_scale, head_dim_ok

log = logging.getLogger(__name__)

NAME = "flashtune"
_fallback_noted: set[str] = set()
_registered: set[str] = set()


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default "flashtune") available to transformers."""
    import flashtune.dispatch  # noqa: F401  (installs the tuned-config resolver)

    try:
        from transformers import AttentionInterface

        AttentionInterface.register(name, attention_forward)
    except ImportError:  # transformers before AttentionInterface: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = attention_forward
    _registered.add(name)
    _skip_flash_attn_import()
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # older transformers build a 4D mask; attention_forward handles it
        return
    AttentionMaskInterface.register(name, flash_attention_mask)


def _skip_flash_attn_import() -> None:
    """transformers 5 treats every implementation whose name contains "flash" as a
    flash-attn kernel to import (from the flash-attn package or the kernels hub) when a
    model is built; for our names there is nothing to import, so skip that step."""
    for modname in ("transformers.modeling_flash_attention_utils", "transformers.modeling_utils"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        orig = getattr(mod, "lazy_import_flash_attention", None)
        if orig is None or getattr(orig, "_flashtune_skip", False):
            continue

        def lazy_import(implementation: Any, *args: Any, _orig: Any = orig, **kw: Any) -> Any:
            if implementation in _registered:
                return None
            return _orig(implementation, *args, **kw)

        lazy_import._flashtune_skip = True  # type: ignore[attr-defined]
        functools.update_wrapper(lazy_import, orig)
        mod.lazy_import_flash_attention = lazy_import  # type: ignore[attr-defined]


def _note_fallback(why: str) -> None:
    if why not in _fallback_noted and not torch.compiler.is_compiling():
        _fallback_noted.add(why)
        log.info("flashtune: attention through SDPA instead of flashtune: %s", why)


def _kernel_can_run(q: torch.Tensor) -> str | None:
    """Why the kernels cannot take this query (None: they can)."""
    from flashtune.kernels.attention import _DTYPES, _INTERPRET

    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (flashtune runs fp16 and bf16)"
    d = q.shape[-1]
    if not head_dim_ok(d):
        return f"head_dim {d}"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _INTERPRET):
        return f"device {q.device}"
    return None


def _is_packed(position_ids: Any, batch: int) -> bool:
    """Several sequences packed in one row (transformers' FA2 rule: batch 1, positions
    that restart); never checked while compiling (it would read the tensor)."""
    if position_ids is None or batch != 1 or torch.compiler.is_compiling():
        return False
    pos = position_ids.reshape(-1)
    return pos.numel() > 1 and bool((pos[1:] != pos[:-1] + 1).any())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D)
    -> ((B, Sq, Hq, D), None)."""
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    cap = float(softcap) if softcap else 0.0

    why = _kernel_can_run(query)
    if why is None and attention_mask is not None:
        why = "a padding mask"
    if why is None and dropout > 0.0:
        why = "attention dropout"
    if why is None and ("cu_seq_lens_q" in kwargs or _is_packed(kwargs.get("position_ids"),
                                                                query.shape[0])):
        why = "packed sequences"
    if why is None:
        from flashtune.kernels.attention import flash_attention

        out = flash_attention(query, key, value, causal=causal, softmax_scale=scaling,
                              window_size=window, softcap=cap)
    else:
        _note_fallback(why)
        out = _sdpa(query, key, value, attention_mask, scaling, dropout, causal, window, cap)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None, dropout: float, causal: bool, window: tuple[int, int],
          softcap: float) -> torch.Tensor:
    """The same attention through SDPA: padding (2D keep-mask or a ready 4D mask), causal
    bottom-right aligned, window and softcap as additive masks."""
    if softcap:
        return _eager(q, k, v, mask, scale, dropout, causal, window, softcap)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    bias = _bias(q, k, mask, causal, window)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale,
        is_causal=bias is None and causal and q.shape[2] == k.shape[2])


def _bias(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          window: tuple[int, int]) -> torch.Tensor | None:
    sq, sk = q.shape[2], k.shape[2]
    if mask is not None and mask.dim() == 4:  # already prepared by the model
        return _additive(mask[..., :sk], q) if mask.dtype == torch.bool \
            else mask[..., :sk].to(q.dtype)
    if mask is None and window == (-1, -1) and (not causal or sq == sk):
        return None
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right aligned
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    keep = keep[None, None]
    if mask is not None:  # (B, Sk) keep-mask of real tokens
        keep = keep & mask[:, None, None, -sk:].bool()
    return _additive(keep, q)


def _additive(keep: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # Additive, not boolean: a fully masked row (left padding) gives a uniform row, never NaN.
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    return torch.where(keep, zero, torch.finfo(q.dtype).min)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None, dropout: float, causal: bool, window: tuple[int, int],
           softcap: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else default_scale(q.shape[-1]))
    s = softcap * torch.tanh(s / softcap)
    bias = _bias(q, k, mask, causal, window)
    if bias is not None:
        s = s + bias
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    p = F.dropout(p, dropout, training=dropout > 0)
    return p @ v
