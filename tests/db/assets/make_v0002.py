"""Wrote tuning_v0002.db: run with flashtune at schema 0002 (commit 22528ed) from the
repository root, `python tests/db/assets/make_v0002.py OUT.db`. Kept to show how the asset
was made; it does not run against later schemas."""

import random
import sys

from flashtune.db import SoftwareInfo, open_storage
from flashtune.problem import Problem
from tests.db import _data

out = sys.argv[1]
H200 = _data.H200
K = "c" * 64
A = SoftwareInfo(torch="2.12.0", triton="3.9.0", cuda="12.6", kernels_hash=K)
B = SoftwareInfo(torch="2.13.0", triton="3.9.0", cuda="12.8", kernels_hash=K)
OLD = SoftwareInfo(torch="2.11.0", triton="3.6.0", cuda="12.6", kernels_hash="d" * 64)
rng = random.Random(5)
p1 = Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=1024, seqlen_k=1024, head_dim=128)
p2 = Problem(batch=4, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=128,
             causal=True)
packed = Problem(batch=8, heads_q=32, heads_kv=8, seqlen_q=2048, seqlen_k=2048, head_dim=128,
                 causal=True, total_q=6000, total_k=6000)
dense = Problem(batch=8, heads_q=32, heads_kv=8, seqlen_q=2000, seqlen_k=2000, head_dim=128,
                causal=True)
rs = [
    _data.result(rng, device=H200, software=A, direction="fwd", p=p1, median_ms=0.5,
                 p20_ms=0.49, p80_ms=0.52, tflops=p1.flops("fwd") / 0.5e9, host="node-a"),
    _data.result(rng, device=H200, software=B, direction="fwd", p=p1, median_ms=0.4,
                 p20_ms=0.39, p80_ms=0.42, tflops=p1.flops("fwd") / 0.4e9, host="node-b"),
    _data.result(rng, device=H200, software=A, direction="bwd", p=p2, median_ms=9.0,
                 p20_ms=8.9, p80_ms=9.2, tflops=p2.flops("bwd") / 9.0e9, host="node-a"),
    _data.result(rng, device=H200, software=OLD, direction="fwd", p=p2, median_ms=3.0,
                 p20_ms=2.9, p80_ms=3.1, tflops=p2.flops("fwd") / 3.0e9, host="node-a"),
    _data.result(rng, device=_data.A100, software=B, direction="bwd", p=p1, median_ms=2.0,
                 p20_ms=1.9, p80_ms=2.1, tflops=p1.flops("bwd") / 2.0e9, host="node-c"),
    # A packed batch and a dense one that shared a key at 0002.
    _data.result(rng, device=H200, software=A, direction="fwd", p=packed, median_ms=1.5,
                 p20_ms=1.4, p80_ms=1.6, tflops=packed.flops("fwd") / 1.5e9, host="node-a"),
    _data.result(rng, device=H200, software=B, direction="fwd", p=dense, median_ms=2.5,
                 p20_ms=2.4, p80_ms=2.6, tflops=dense.flops("fwd") / 2.5e9, host="node-b"),
]
assert packed.key("fwd") == dense.key("fwd")
with open_storage(out) as s:
    assert s.put_results(rs) == ["added"] * 7
    s.record_misses(H200, B, {p2.key("bwd"): (3, p2), packed.key("bwd"): (2, packed)})
print("ok")
