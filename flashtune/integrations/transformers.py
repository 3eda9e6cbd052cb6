"""``attn_implementation="tuned_attention"`` for Hugging Face transformers models.

::

    import flashtune.integrations.transformers as ft_hf
    ft_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ft_hf.NAME)

Registers :func:`attention_forward` with transformers' ``AttentionInterface`` and, where
the installed transformers has one, the FA2-style mask with ``AttentionMaskInterface``
(a 2-D padding mask, or none). The name has no "flash" in it on purpose: transformers
treats every implementation whose name contains "flash" as a flash-attn package to
import when a model is built, and there is nothing to import for flashtune. No
transformers function is patched.

Llama-family models then run flashtune's kernels with the tuned config: GQA without
repeating K/V, causal, the model's sliding window (``sliding_window=W`` sees W keys
including itself: ``window_size=(W-1, 0)``) and logit softcapping, on

- plain batches: :func:`flashtune.flash_attention`;
- padding-free packed batches (``DataCollatorWithFlattening``: ``cu_seq_lens_*`` /
  ``max_length_*`` when it returns flash-attn kwargs, else ``position_ids`` that restart
  at 0 in a batch of one row): :func:`flashtune.flash_attn_varlen_func`;
- padded batches (a 2-D padding mask): unpadded, run through the varlen kernels, and
  padded back (padding rows get zeros).

Calls the kernels cannot serve (attention dropout, fp32 models, unsupported head dims, a
4-D mask, a padding mask under ``torch.compile``) run through PyTorch's SDPA with the
same semantics, with one WARNING per reason per process.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashtune.problem import default_scale, head_dim_ok

log = logging.getLogger(__name__)

NAME = "tuned_attention"
_fallback_noted: set[str] = set()
# How often each path ran (tests read it to tell the kernels from the fallback).
calls = {"dense": 0, "packed": 0, "padded": 0, "fallback": 0}


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default :data:`NAME`) available to transformers."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash': transformers would try to import a "
                         "flash-attn package for it when a model is built; choose another name")
    import flashtune.dispatch

    flashtune.dispatch.install()  # the tuned configs

    try:
        from transformers import AttentionInterface

        AttentionInterface.register(name, attention_forward)
    except ImportError:  # transformers before AttentionInterface: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = attention_forward
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # older transformers build a 4D mask; attention_forward falls back
        return
    AttentionMaskInterface.register(name, flash_attention_mask)


def _note_fallback(why: str) -> None:
    calls["fallback"] += 1
    if why not in _fallback_noted and not torch.compiler.is_compiling():
        _fallback_noted.add(why)
        log.warning("flashtune: attention through SDPA instead of flashtune: %s", why)


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


Seqs = tuple[torch.Tensor, torch.Tensor, int, int]  # cu_seqlens_q, cu_seqlens_k, max_q, max_k
_memo: dict[str, tuple[Any, Any]] = {}


def _once_per_tensor(kind: str, t: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn(t)``, remembered for the last tensor object of this kind: every layer of a model
    gets the same ``position_ids`` / mask, and reading them syncs with the device."""
    hit = _memo.get(kind)
    if hit is not None and hit[0]() is t:
        return hit[1]
    out = fn(t)
    _memo[kind] = (weakref.ref(t), out)
    return out


def _seqs_from_positions(position_ids: torch.Tensor) -> Seqs | None:
    """The sequences of one packed row (a new one wherever the positions do not go up by
    one, transformers' rule), or None when the row is a single sequence."""
    pos = position_ids.reshape(-1)
    if pos.numel() < 2:
        return None
    cuts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    if cuts.numel() == 0:
        return None
    bounds = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), pos.numel())])
    bounds = bounds.to(torch.int32)
    longest = int(bounds.diff().max())
    return bounds, bounds, longest, longest


def _packed_seqs(kwargs: dict[str, Any], batch: int, same_length: bool) -> Seqs | None:
    """A packed batch's sequences, from flash-attn kwargs or restarting ``position_ids``."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if max_q is None or max_k is None:
            max_q, max_k = (_once_per_tensor(f"max{i}", t, lambda c: int(c.diff().max()))
                            for i, t in ((0, cu_q), (1, cu_k)))
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or not same_length or torch.compiler.is_compiling():
        return None  # (compiled packed training: pass the collator's flash-attn kwargs)
    return _once_per_tensor("positions", pos, _seqs_from_positions)  # type: ignore[no-any-return]


def _unpad_index(mask: torch.Tensor, sq: int) -> tuple[torch.Tensor, torch.Tensor, Seqs]:
    """Rows to keep of the flattened (B * Sq) queries and (B * Sk) keys, and the sequences
    they form, for a 2-D keep-mask (B, Sk): the queries are the last Sq positions."""
    keep_k = mask.bool()
    keep_q = keep_k[:, -sq:]

    def cu(keep: torch.Tensor) -> tuple[torch.Tensor, int]:
        lens = keep.sum(1, dtype=torch.int32)
        return F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)), int(lens.max())

    (cu_q, max_q), (cu_k, max_k) = cu(keep_q), cu(keep_k)
    return (torch.nonzero(keep_q.reshape(-1)).reshape(-1),
            torch.nonzero(keep_k.reshape(-1)).reshape(-1), (cu_q, cu_k, max_q, max_k))


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Seqs, **kw: Any,
            ) -> torch.Tensor:
    from flashtune.kernels.varlen import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k, v, *seqs, **kw)
    assert isinstance(out, torch.Tensor)
    return out


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
    # transformers passes flash-attn's ``deterministic`` through its kwargs; flashtune's
    # default is deterministic gradients.
    deterministic = bool(kwargs.get("deterministic", True))
    kw: dict[str, Any] = dict(causal=causal, softmax_scale=scaling, window_size=window,
                              softcap=cap, deterministic=deterministic)

    why = _kernel_can_run(query)
    if why is None and dropout > 0.0:
        why = "attention dropout"
    if why is None and attention_mask is not None and attention_mask.dim() != 2:
        why = f"a {attention_mask.dim()}-D attention mask (flashtune takes a 2-D padding mask)"
    if why is None and attention_mask is not None and torch.compiler.is_compiling():
        why = "a padding mask under torch.compile (unpadding reads the mask)"
    if why is not None:
        _note_fallback(why)
        out = _sdpa(query, key, value, attention_mask, scaling, dropout, causal, window, cap)
        return out.transpose(1, 2).contiguous(), None

    b, hq, sq, d = query.shape
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views
    if attention_mask is not None:  # padded batch: unpad, varlen, pad back
        calls["padded"] += 1
        iq, ik, seqs = _once_per_tensor(f"mask{sq}", attention_mask,
                                        lambda m: _unpad_index(m, sq))
        flat_k = (t.reshape(-1, *t.shape[2:]) for t in (k, v))
        ku, vu = (t.index_select(0, ik) for t in flat_k)
        qu = q.reshape(-1, hq, d).index_select(0, iq)
        out_u = _varlen(qu, ku, vu, seqs, **kw)
        out = out_u.new_zeros(b * sq, hq, d).index_copy(0, iq, out_u)
        return out.view(b, sq, hq, d), None
    seqs = _packed_seqs(kwargs, b, sq == key.shape[2])
    if seqs is not None:  # padding-free packed batch: one row of concatenated sequences
        calls["packed"] += 1
        out = _varlen(q.reshape(-1, hq, d), k.reshape(-1, *k.shape[2:]),
                      v.reshape(-1, *v.shape[2:]), seqs, **kw)
        return out.view(b, sq, hq, d), None
    from flashtune.kernels.attention import flash_attention

    calls["dense"] += 1
    dense = flash_attention(query, key, value, **kw)
    assert isinstance(dense, torch.Tensor)
    return dense.transpose(1, 2).contiguous(), None


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
