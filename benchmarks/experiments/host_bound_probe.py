"""Why do some bench rows read every implementation slow? For each problem (the rows of
session 65's slow readings, in the bench's order), the training step's (fwd+bwd) host
issue time of tuned, cuDNN and Flex (read while a GPU spin keeps the GPU ahead), its
time in the bench's loop (time_interleaved), its time with a GPU spin before each launch
(GPU time alone), and the caching allocator's device allocations, frees and syncs in
each loop. Session 65 (BENCHMARKS.md, issue 13): host_bound_diag_h200_s65.json.

    FLASHTUNE_DB=/tmp/none.db python benchmarks/experiments/host_bound_probe.py  # $OUT/diag.json

(What it found is now the bench's own: ``--lead-ms`` and each row's "host".)
"""
import json, os, time, warnings
import torch
from flashtune.problem import Problem
from flashtune.cli.bench import _impls
from flashtune.dispatch._table import load_table
from flashtune.db.fingerprint import device_info  # noqa
from flashtune.timing import make_inputs, _launch, time_interleaved, _turns

warnings.simplefilter("ignore")
from flashtune._env import database_url
table = load_table(device_info(), database_url())
assert table.error is None, table.error
P = lambda b, h, s, d, c, hk=None: Problem(batch=b, heads_q=h, heads_kv=hk or h, seqlen_q=s, seqlen_k=s, head_dim=d, dtype="bf16", causal=c)
probs = [P(2,32,8192,64,True), P(16,12,1024,64,True), P(64,12,256,64,True), P(16,12,1024,64,True),
         P(1,16,16384,128,True), P(32,16,512,128,True)]
STATS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")

def padded(fns, rep_ms=100, cycles=1_500_000):
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for i in _turns(4, len(fns)):
        flush.zero_(); fns[i]()
    torch.cuda.synchronize()
    order = _turns(200, len(fns))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
    for i, (a, b) in zip(order, ev):
        flush.zero_(); torch.cuda._sleep(cycles); a.record(); fns[i](); b.record()
    torch.cuda.synchronize()
    t = [[] for _ in fns]
    for i, (a, b) in zip(order, ev): t[i].append(a.elapsed_time(b))
    return [sorted(x)[len(x)//2] for x in t]

out = []
for p in probs:
    impls, _ = _impls(p, table, False, frozenset({"tuned", "cudnn", "flex"}))
    q, k, v = make_inputs(p, "cuda", requires_grad=True)
    do = torch.randn_like(q)
    names = list(impls)
    fns = [_launch("fwd_bwd", impls[n], q=q, k=k, v=v, do=do) for n in names]
    for f in fns: f()
    torch.cuda.synchronize()
    issue = {}
    for n, f in zip(names, fns):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU work ahead: issue never waits for it
        s = time.perf_counter()
        for _ in range(10): f()
        issue[n] = (time.perf_counter() - s) / 10 * 1e3
        torch.cuda.synchronize()
    m0 = torch.cuda.memory_stats()
    std = [t.median_ms for t in time_interleaved(fns)]
    m1 = torch.cuda.memory_stats()
    pad = padded(fns)
    m2 = torch.cuda.memory_stats()
    row = {"shape": f"{p.batch}x{p.heads_q}x{p.seqlen_q}x{p.head_dim}{' causal' if p.causal else ''}",
           "fwd_bwd_ms": dict(zip(names, [round(x, 4) for x in std])),
           "padded_ms": dict(zip(names, [round(x, 4) for x in pad])),
           "issue_ms": {n: round(x, 4) for n, x in issue.items()},
           "alloc_std": {s: m1.get(s, 0) - m0.get(s, 0) for s in STATS},
           "alloc_pad": {s: m2.get(s, 0) - m1.get(s, 0) for s in STATS},
           "load": os.getloadavg()[0]}
    out.append(row); print(json.dumps(row), flush=True)
    del q, k, v, do, fns, impls
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "diag.json"), "w"), indent=1)
