"""Shape sets for ``autotune sweep`` and ``autotune bench``: presets and shapes files.

A preset expands to a list of :class:`~flashtune.problem.Problem`. ``standard`` is
the house matrix of DESIGN.md; the model presets take heads, KV heads, head dim and
sliding window from each model's published config and use whole-model head counts
(no tensor parallelism), causal masks, bf16, and ``batch * seqlen = 16384`` tokens
per step, as the house matrix does. ``docs/presets.md`` lists every expansion.

A shapes file (YAML or JSON) is a list of objects with the keys of :data:`SHAPE_KEYS`;
a missing key takes its default from :data:`SHAPE_DEFAULTS`. A shape with ``tokens`` is a
packed (varlen) batch: ``batch`` sequences of at most ``seqlen`` tokens, ``tokens`` in all
(tuned on :meth:`Problem.packed_lengths`: one sequence of ``seqlen``, the rest equal).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtune.problem import DTYPES, Problem

TOKENS = 16384  # batch * seqlen per step, as in the house matrix


@dataclass(frozen=True)
class Model:
    """The attention shape of one model family (from its published config)."""

    heads: int
    kv_heads: int
    head_dim: int
    seqlens: tuple[int, ...]
    sliding_window: int | None = None  # tokens each query sees (Mistral-7B v0.1)


MODELS: dict[str, Model] = {
    # num_attention_heads / num_key_value_heads / hidden_size // heads of each config.json.
    "llama3-8b": Model(heads=32, kv_heads=8, head_dim=128, seqlens=(1024, 2048, 4096, 8192)),
    "llama3-70b": Model(heads=64, kv_heads=8, head_dim=128, seqlens=(1024, 2048, 4096, 8192)),
    "mistral-7b": Model(heads=32, kv_heads=8, head_dim=128, seqlens=(1024, 2048, 4096, 8192),
                        sliding_window=4096),
    "qwen2.5-7b": Model(heads=28, kv_heads=4, head_dim=128, seqlens=(1024, 2048, 4096, 8192)),
    # GPT-2 small: 12 heads of 64, full multi-head attention, 1024-token context.
    "gpt2": Model(heads=12, kv_heads=12, head_dim=64, seqlens=(256, 512, 1024)),
}


def model_problems(m: Model) -> list[Problem]:
    """One causal bf16 problem per sequence length, ``TOKENS`` tokens per step.

    A sliding window is set only when the sequence is longer than it, as Hugging Face
    transformers does when it calls flash-attention: shorter sequences see no window.
    """
    out = []
    for s in m.seqlens:
        window = (-1, -1)
        if m.sliding_window is not None and s > m.sliding_window:
            window = (m.sliding_window - 1, 0)  # the query itself plus window-1 keys back
        out.append(Problem(batch=max(TOKENS // s, 1), heads_q=m.heads, heads_kv=m.kv_heads,
                           seqlen_q=s, seqlen_k=s, head_dim=m.head_dim, dtype="bf16",
                           causal=True, window=window))
    return out


def _standard() -> list[Problem]:
    from flashtune.timing import standard_matrix

    return standard_matrix()


def _tiny() -> list[Problem]:
    # Small enough for Triton's CPU interpreter: a smoke test and a demo, not a tuning target.
    return [Problem(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_k=64, head_dim=32,
                    dtype="fp16", causal=c) for c in (False, True)]


def _model(m: Model) -> Callable[[], list[Problem]]:
    return lambda: model_problems(m)


def _packed() -> list[Problem]:
    # Packed (varlen) training batches of a Llama-3-8B-shaped model: (sequences, longest,
    # tokens). The first is issue 15's benchmark batch (64 sequences, up to 8k, 64k tokens).
    m = MODELS["llama3-8b"]
    return [Problem(batch=n, heads_q=m.heads, heads_kv=m.kv_heads, seqlen_q=s, seqlen_k=s,
                    head_dim=m.head_dim, dtype="bf16", causal=True, total_q=t, total_k=t)
            for n, s, t in ((64, 8192, 65536), (32, 4096, 16384), (16, 2048, 16384))]


PRESETS: dict[str, Callable[[], list[Problem]]] = {
    "standard": _standard,
    **{name: _model(m) for name, m in MODELS.items()},
    "llama3-8b-packed": _packed,
    "tiny": _tiny,
}


def preset(name: str) -> list[Problem]:
    """The problems of preset ``name`` (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


# ------------------------------------------------------------------------- shapes files

SHAPE_KEYS = ("batch", "heads", "kv_heads", "seqlen", "seqlen_k", "head_dim", "dtype",
              "causal", "window", "softcap", "tokens", "deterministic")
SHAPE_DEFAULTS: dict[str, Any] = {
    "batch": 1, "heads": 16, "kv_heads": None,  # None: same as heads
    "seqlen": 1024, "seqlen_k": None,  # None: same as seqlen
    "head_dim": 128, "dtype": "bf16", "causal": False, "window": None, "softcap": 0.0,
    "tokens": None,  # None: a dense batch; an int: a packed batch of that many tokens
    "deterministic": True,  # the backward's kind: false also tunes variants with a free dQ order
}


def _window(v: Any, causal: bool, where: str) -> tuple[int, int]:
    """None -> unbounded; an int w -> (w, 0) if causal else (w, w); a pair -> itself."""
    if v is None:
        return (-1, -1)
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, 0) if causal else (v, v)
    if (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        return (v[0], v[1])
    raise ValueError(f"{where}: window must be null, an int or a [left, right] pair of ints, "
                     f"got {v!r}")


def shape_problem(d: Any, where: str = "shape") -> Problem:
    """The :class:`Problem` of one shapes-file object (missing keys take defaults)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object with keys {', '.join(SHAPE_KEYS)}, "
                         f"got {d!r}")
    unknown = sorted(set(d) - set(SHAPE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; "
                         f"allowed: {', '.join(SHAPE_KEYS)}")
    v = {**SHAPE_DEFAULTS, **d}
    for name in ("batch", "heads", "seqlen", "head_dim"):
        if isinstance(v[name], bool) or not isinstance(v[name], int):
            raise ValueError(f"{where}: {name} must be an int, got {v[name]!r}")
    if v["dtype"] not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {v['dtype']!r}")
    if not isinstance(v["causal"], bool):
        raise ValueError(f"{where}: causal must be true or false, got {v['causal']!r}")
    if not isinstance(v["deterministic"], bool):
        raise ValueError(f"{where}: deterministic must be true or false, got "
                         f"{v['deterministic']!r}")
    if isinstance(v["softcap"], bool) or not isinstance(v["softcap"], (int, float)):
        raise ValueError(f"{where}: softcap must be a number, got {v['softcap']!r}")
    tokens = v["tokens"]
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or not v["seqlen"] <= tokens <= v["batch"] * v["seqlen"]):
        raise ValueError(f"{where}: tokens (a packed batch's total) must be an int from seqlen "
                         f"to batch * seqlen, got {tokens!r}")
    try:
        return Problem(
            batch=v["batch"], heads_q=v["heads"],
            heads_kv=v["heads"] if v["kv_heads"] is None else v["kv_heads"],
            seqlen_q=v["seqlen"], seqlen_k=v["seqlen"] if v["seqlen_k"] is None else v["seqlen_k"],
            head_dim=v["head_dim"], dtype=v["dtype"], causal=v["causal"],
            window=_window(v["window"], v["causal"], where), softcap=float(v["softcap"]),
            total_q=tokens or 0, total_k=tokens or 0, deterministic=v["deterministic"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_shapes(path: str | Path) -> list[Problem]:
    """Problems from a YAML or JSON shapes file (a list, or ``{"shapes": [...]}``)."""
    path = Path(path)
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        raise ValueError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                         f"{' '.join(str(e).split())}") from None
    if isinstance(data, dict) and set(data) == {"shapes"}:
        data = data["shapes"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of shape objects")
    return [shape_problem(d, f"{path}: shape {i + 1}") for i, d in enumerate(data)]
