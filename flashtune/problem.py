"""The attention problem and its bucketed key.

:class:`Problem` is one concrete call: every shape and flag. :class:`ProblemKey`
is what the tuner stores and the dispatcher looks up: the fields that change
which config is fastest, with sizes rounded into buckets so that nearby shapes
share a tuned entry. The tuner, the dispatcher and the database all build keys
through :meth:`Problem.key`, so the two sides can never disagree.

Buckets: ``batch * heads_q`` and each sequence length round *up* to the next
power of two (``bucket(1000) == 1024``, ``bucket(1024) == 1024``,
``bucket(1025) == 2048``), clamped below at 1 and above at ``MAX_BUCKET``. Head
dim, dtype, mask kind and GQA ratio are exact.

Packed (varlen) batches have keys of their own: ``packed`` is True, ``tokens_bucket`` is
the bucket of the query tokens, and ``sq_bucket`` / ``sk_bucket`` bucket the *longest*
sequence (``bh_bucket`` counts sequences times heads). A dense key has ``packed`` False and
``tokens_bucket`` 0. ``deterministic`` is part of the backward key (a ``False`` backward may
use variants whose dQ accumulation order is not fixed); a forward key always has it True,
so forward entries are shared by both kinds of call.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

DTYPES = ("fp16", "bf16")
DIRECTIONS = ("fwd", "bwd")
MAX_BUCKET = 1 << 20
# Each size of a problem: the kernels index rows within one head in int32.
MAX_SIZE = 2**31 - 1
HEAD_DIMS = "a multiple of 8 in [16, 256]"


def head_dim_ok(d: int) -> bool:
    """The head dims the kernels run: any multiple of 8 from 16 to 256."""
    return d % 8 == 0 and 16 <= d <= 256


def default_scale(head_dim: int) -> float:
    """The softmax scale when the caller gives none: 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)

# A softcap at or above this is no softcap (its limit). The kernels take cap * log2(e) as an
# fp32 scalar (finite below 3.4e38); with |q.k| <= 65504**2 * 256 ~ 1.1e12 and a softmax scale
# <= 1e20, |s / cap| <= 1.1e-4 here, where cap * tanh(s / cap) is s to 4e-9 relative.
SOFTCAP_LIMIT = 1e36
# ... and so is a softcap this many times the softmax scale: the kernels multiply q.k by
# scale / cap in fp32, which must stay a normal number (>= 1.2e-38) for scores to survive.
SOFTCAP_SCALE_RATIO = 2.0**64


def effective_window(window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """``window`` with every bound that reaches past the sequence replaced by -1 (unbounded).

    With ``offset = seqlen_k - seqlen_q`` (bottom-right alignment), query ``i`` sees keys
    ``[i + offset - left, i + offset + right]``: a ``left >= seqlen_k - 1`` or a
    ``right >= seqlen_q - 1`` hides no key from any query. Clamping keeps sentinels such as
    ``2**31 - 1`` out of the kernels' int32 index arithmetic, and gives the problem key the
    mask the call actually has.
    """
    left, right = (int(w) for w in window)
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    return left, right


def effective_softcap(softcap: float, scale: float | None = None) -> float:
    """``softcap``, or 0.0 (off: its limit) at or above :data:`SOFTCAP_LIMIT`, or, given the
    softmax ``scale``, at or above ``scale * SOFTCAP_SCALE_RATIO``. Infinity is off too."""
    if softcap >= SOFTCAP_LIMIT or (scale is not None and softcap >= scale * SOFTCAP_SCALE_RATIO):
        return 0.0
    return float(softcap)


def bucket(n: int) -> int:
    """Round ``n`` up to the next power of two (1 for n <= 1), capped at MAX_BUCKET."""
    if n <= 1:
        return 1
    return min(1 << (int(n) - 1).bit_length(), MAX_BUCKET)


@dataclass(frozen=True, order=True)
class ProblemKey:
    """The database / dispatch key. Field names mirror the ``problems`` table's columns."""

    direction: str
    dtype: str
    head_dim: int
    causal: bool
    window: bool
    softcap: bool
    gqa_ratio: int
    bh_bucket: int
    sq_bucket: int
    sk_bucket: int
    deterministic: bool = True
    packed: bool = False
    tokens_bucket: int = 0  # the bucket of a packed batch's query tokens; 0 when dense

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProblemKey:
        """The key of ``as_dict()`` output; fields added since (deterministic, packed,
        tokens_bucket) take their defaults when absent."""
        return cls(**{f: d[f] for f in cls.__dataclass_fields__ if f in d})

    def family(self) -> tuple[str, str, int, bool, bool, bool, bool]:
        """Fields that must match for a *nearest* bucket to be served."""
        return (self.direction, self.dtype, self.head_dim, self.causal, self.window, self.softcap,
                self.packed)

    def serves(self, wanted: ProblemKey) -> bool:
        """Whether an entry stored under this key may be served, as nearest, for ``wanted``:
        the same family, and never a non-deterministic entry to a deterministic call (a
        deterministic entry may serve a non-deterministic call)."""
        return self.family() == wanted.family() \
            and (self.deterministic or not wanted.deterministic)

    def distance(self, other: ProblemKey) -> float:
        """Log2 distance from this (stored) key to the ``other`` (wanted) key; inf where this
        key's entry cannot serve ``other`` (:meth:`serves`). A deterministic entry serving a
        non-deterministic call costs one bucket step (a faster variant may exist)."""
        if not self.serves(other):
            return math.inf
        d = 0.0 if self.deterministic == other.deterministic else 1.0
        for a, b in ((self.bh_bucket, other.bh_bucket), (self.sq_bucket, other.sq_bucket),
                     (self.sk_bucket, other.sk_bucket),
                     (max(self.tokens_bucket, 1), max(other.tokens_bucket, 1))):
            d += abs(math.log2(a) - math.log2(b))
        if self.gqa_ratio != other.gqa_ratio:
            d += 0.5 * abs(math.log2(self.gqa_ratio) - math.log2(other.gqa_ratio)) + 0.25
        return d

    def short(self) -> str:
        """E.g. ``bwd bf16 d128 causal+win g4 bh64 sq1024 sk1024``; a non-deterministic
        backward adds ``nondet``, a packed batch ``packed tok65536``."""
        mask = "causal" if self.causal else "full"
        extra = ("+win" if self.window else "") + ("+cap" if self.softcap else "")
        tail = ("" if self.deterministic else " nondet") \
            + (f" packed tok{self.tokens_bucket}" if self.packed else "")
        return (f"{self.direction} {self.dtype} d{self.head_dim} {mask}{extra} g{self.gqa_ratio} "
                f"bh{self.bh_bucket} sq{self.sq_bucket} sk{self.sk_bucket}{tail}")


@dataclass(frozen=True)
class Problem:
    """One concrete attention problem: q is (batch, heads_q, seqlen_q, head_dim)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    window: tuple[int, int] = field(default=(-1, -1))
    softcap: float = 0.0
    # The backward's kind: True (the default) asks for bit-identical gradients; False lets
    # the tuner and the dispatcher use variants whose dQ accumulation order is not fixed.
    deterministic: bool = True
    # Packed (varlen) batches: the token totals (0 for a dense batch). ``batch`` is then the
    # number of sequences and ``seqlen_q`` / ``seqlen_k`` the longest sequence's lengths.
    total_q: int = 0
    total_k: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SIZE:
                raise ValueError(f"{name} must be an int from 1 to {MAX_SIZE}, got {v!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q={self.heads_q} must be a multiple of heads_kv={self.heads_kv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not head_dim_ok(self.head_dim):
            raise ValueError(f"head_dim must be {HEAD_DIMS}, got {self.head_dim}")
        w = tuple(int(x) for x in self.window)
        if len(w) != 2 or any(x < -1 for x in w):
            raise ValueError(f"window must be (left, right) with each >= -1, got {self.window!r}")
        object.__setattr__(self, "window", effective_window(w, self.seqlen_q, self.seqlen_k))
        if not self.softcap >= 0.0:
            raise ValueError(f"softcap must be a float >= 0 (0: off), got {self.softcap!r}")
        object.__setattr__(self, "softcap", effective_softcap(self.softcap))
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        for name in ("total_q", "total_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: not packed), got {v!r}")
        if (self.total_q > 0) != (self.total_k > 0):
            raise ValueError(f"total_q and total_k are both 0 (dense) or both > 0 (packed), "
                             f"got {self.total_q} and {self.total_k}")

    @property
    def packed(self) -> bool:
        """A packed (varlen) batch: ``batch`` sequences of up to seqlen_q / seqlen_k tokens."""
        return self.total_q > 0

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    def key(self, direction: str) -> ProblemKey:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return ProblemKey(
            direction=direction, dtype=self.dtype, head_dim=self.head_dim,
            causal=bool(self.causal), window=self.has_window, softcap=self.softcap > 0,
            gqa_ratio=self.gqa_ratio, bh_bucket=bucket(self.batch * self.heads_q),
            sq_bucket=bucket(self.seqlen_q), sk_bucket=bucket(self.seqlen_k),
            deterministic=self.deterministic or direction == "fwd", packed=self.packed,
            tokens_bucket=bucket(self.total_q) if self.packed else 0)

    def dims(self) -> str:
        """``BxHq[/Hkv]xSq[xSk]xD``: the shape, with Hkv and Sk only where they differ."""
        kv = f"/{self.heads_kv}" if self.heads_kv != self.heads_q else ""
        sk = f"x{self.seqlen_k}" if self.seqlen_k != self.seqlen_q else ""
        return f"{self.batch}x{self.heads_q}{kv}x{self.seqlen_q}{sk}x{self.head_dim}"

    def label(self) -> str:
        """A one-line label for people: shape, dtype and mask, e.g. ``2x8/2x1000x128 bf16
        causal win[128, 0]``; a packed batch adds its tokens (``packed 65536 tok``)."""
        tokens = str(self.total_q) if self.total_q == self.total_k \
            else f"{self.total_q}/{self.total_k}"
        extra = (" causal" if self.causal else "") \
            + (f" win{list(self.window)}" if self.has_window else "") \
            + (f" cap{self.softcap:g}" if self.softcap else "") \
            + (f" packed {tokens} tok" if self.packed else "") \
            + ("" if self.deterministic else " nondet")
        return f"{self.dims()} {self.dtype}{extra}"

    def flops(self, direction: str = "fwd") -> float:
        """House protocol: fwd = 4*B*Hq*Sq*Sk*D, halved for causal when Sq == Sk; bwd = 2.5x.
        A packed batch counts each sequence of :meth:`packed_lengths` on its own."""
        if self.packed:
            f = sum(4.0 * self.heads_q * a * b * self.head_dim / (2 if self.causal and a == b
                                                                 else 1)
                    for a, b in zip(*self.packed_lengths(), strict=True))
        else:
            f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
            if self.causal and self.seqlen_q == self.seqlen_k:
                f /= 2
        return f * (2.5 if direction == "bwd" else 1.0)

    def packed_lengths(self) -> tuple[list[int], list[int]]:
        """The (query, key) lengths of a representative packed batch for this problem, for
        tuning and benchmarks: one sequence as long as ``seqlen_q`` / ``seqlen_k``, the other
        tokens spread evenly over the other ``batch - 1`` sequences (none longer than the
        longest; with Sq == Sk and equal totals the two lists are equal)."""
        def spread(longest: int, total: int) -> list[int]:
            first = min(longest, total)
            rest, n = total - first, self.batch - 1
            return [first] + [min(longest, rest // n + (i < rest % n)) for i in range(n)] \
                if n else [first]

        return spread(self.seqlen_q, self.total_q), spread(self.seqlen_k, self.total_k)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window"] = list(self.window)
        if not self.packed:  # a dense problem's dict is what it was before packed batches
            del d["total_q"], d["total_k"]
        if self.deterministic:  # ... and a deterministic one's what it was before the flag
            del d["deterministic"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Problem:
        d = dict(d)
        d["window"] = tuple(d.get("window", (-1, -1)))
        return cls(**d)

    @classmethod
    def from_tensors(cls, q: Any, k: Any, *, causal: bool = False,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     deterministic: bool = True) -> Problem:
        from flashtune._env import dtype_name

        dt = dtype_name(q.dtype)
        b, hq, sq, d = q.shape
        return cls(batch=b, heads_q=hq, heads_kv=k.shape[1], seqlen_q=sq, seqlen_k=k.shape[2],
                   head_dim=d, dtype=dt, causal=bool(causal),
                   window=(int(window_size[0]), int(window_size[1])),
                   softcap=float(softcap), deterministic=bool(deterministic))
