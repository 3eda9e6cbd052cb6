"""One-off: which (kernel, config, shape) hits an illegal memory access? One process each.

Same setup as fwd_variant_ab.py (variant from the package at 0918504, previous kernel in
.exp/attn_fwd_old.py). Data: benchmarks/data/fwd_variant_ima_h200.json.
"""

import json
import os
import subprocess
import sys

CHILD = r"""
import sys, json, importlib.util, torch
sys.path.insert(0, ".")
kern, bm, bn, w, st, nreg, b, h, s, d, causal = json.loads(sys.argv[1])
if kern == "old":
    spec = importlib.util.spec_from_file_location("attn_fwd_old", ".exp/attn_fwd_old.py")
    M = importlib.util.module_from_spec(spec); spec.loader.exec_module(M)
else:
    import flashtune.kernels.attn_fwd as M
from flashtune.kernels.config import FwdConfig
c = FwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, maxnreg=nreg)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
res = {}
try:
    for rep in range(20):
        o, lse = M.attn_fwd(q, k, v, causal=causal, sm_scale=d ** -0.5, window=(-1, -1), softcap=0.0, config=c)
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float(), is_causal=causal)
    res["err"] = float((o[:1].float() - ref).abs().max())
    res["result"] = "ok"
except Exception as e:
    res["result"] = type(e).__name__ + ": " + str(e).splitlines()[0][:120]
print("RESULT " + json.dumps(res))
"""
cases = []
shapes = [
    (8, 32, 2048, 64, False),
    (32, 32, 512, 64, False),
    (8, 32, 2048, 64, True),
    (8, 16, 2048, 128, False),
]
cfgs = [
    (128, 32, 4, 3, 0),
    (128, 32, 4, 2, 0),
    (128, 32, 4, 4, 0),
    (128, 32, 8, 3, 0),
    (64, 32, 4, 3, 0),
    (128, 64, 4, 3, 0),
    (128, 16, 4, 3, 0),
]
out = []
for kern in ("new", "old"):
    for shp in shapes[:2]:
        for cfg in cfgs:
            cases.append((kern, *cfg, *shp))
    for shp in shapes[2:]:
        cases.append((kern, 128, 32, 4, 3, 0, *shp))
for case in cases:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True, timeout=120
    )
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    res = (
        json.loads(line[0][7:])
        if line
        else {
            "result": "child died rc=%d: %s"
            % (r.returncode, r.stderr.strip().splitlines()[-1][:150] if r.stderr.strip() else "")
        }
    )
    out.append({"case": case, **res})
    print(case, res, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ima.json"), "w"), indent=1)
