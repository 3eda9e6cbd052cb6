"""Where the Hopper backward's host time goes, and how long a training step takes to issue
(session 66, BENCHMARKS.md issue 13). For each problem, with the shipped config the bench
serves (``FLASHTUNE_DB`` at a missing file) and the extension built (``FLASHTUNE_NATIVE=1``):

- ``step_issue`` / ``fwd_issue``: host time to issue one fwd+bwd step / one forward, tuned
  and cuDNN, read with GPU work queued ahead (median of 20), and ``native_counts_delta``:
  (backwards the C++ node ran from a program, backwards it ran through Python) meanwhile;
- ``plan_backward``: ``Plan.backward`` called from Python (the node's Python path);
- ``py_node_step``: the step through the Python autograd Function instead of the node;
- for the Hopper launch: ``buffers`` and ``run`` of the prepared launch, and for an unsplit
  one its launches one by one;
- a cProfile of 100 ``Plan.backward`` calls (``$OUT/host_prof.txt``).

    FLASHTUNE_NATIVE=1 FLASHTUNE_DB=/tmp/none.db python benchmarks/experiments/host_issue_probe.py

Session 66 ran it before the node ran Hopper programs (host_issue_h200_s66_python.json,
host_issue_profile_h200_s66_python.txt) and after (host_issue_h200_s66_native.json).
"""
import cProfile, io, json, os, pstats, statistics, sys, time, warnings
import torch
warnings.simplefilter("ignore")
from flashtune.problem import Problem
from flashtune.cli.bench import _impls
from flashtune.dispatch._table import load_table
from flashtune.db.fingerprint import device_info
from flashtune._env import database_url
from flashtune.timing import make_inputs, _launch, gpu_wait
from flashtune.kernels import _native, _plans, _bound
from flashtune.kernels._autograd import Attention

OUT = os.environ.get("OUT", "/tmp")
table = load_table(device_info(), database_url())
assert table.error is None, table.error
print("native", _native.mode(), flush=True)

def issue(f, calls=20, wait=100.0):
    gpu_wait(wait)
    ts = []
    for _ in range(calls):
        s = time.perf_counter(); f(); ts.append((time.perf_counter() - s) * 1e3)
    torch.cuda.synchronize()
    return round(statistics.median(ts), 4)

P = lambda b, h, s, d, c, det=True: Problem(batch=b, heads_q=h, heads_kv=h, seqlen_q=s, seqlen_k=s,
                                           head_dim=d, dtype="bf16", causal=c, deterministic=det)
probs = [P(16, 12, 1024, 64, True), P(2, 32, 8192, 64, True), P(32, 16, 512, 128, True),
         P(1, 16, 16384, 128, True), P(64, 12, 256, 64, True), P(4, 32, 4096, 64, False, False)]
rows = []
prof_txt = io.StringIO()
for p in probs:
    r = {"problem": p.label() if hasattr(p, "label") else str(p)}
    impls, _ = _impls(p, table, False, frozenset({"tuned", "cudnn"}))
    q, k, v = make_inputs(p, "cuda", requires_grad=True)
    do = torch.randn_like(q)
    fb = {n: _launch("fwd_bwd", impls[n], q=q, k=k, v=v, do=do) for n in impls}
    ff = {n: _launch("fwd", impls[n], q=q, k=k, v=v, do=do) for n in impls}
    for f in (*fb.values(), *ff.values()):
        f(); f()
    torch.cuda.synchronize()
    # the native module: wait until it is built so the C++ node serves
    for _ in range(200):
        if _native.module() is not None or _native.settled():
            break
        time.sleep(1)
    for f in fb.values():
        f()
    torch.cuda.synchronize()
    r["native"] = _native.module() is not None
    c0 = _native.module().counts()
    r["step_issue"] = {n: issue(f) for n, f in fb.items()}
    r["native_counts_delta"] = [a - b for a, b in zip(_native.module().counts(), c0)]
    r["fwd_issue"] = {n: issue(f) for n, f in ff.items()}
    plans = [pl for pl in _plans.caches["call"].values() if pl.bwd and pl.problem.seqlen_q == p.seqlen_q
             and pl.problem.batch == p.batch and pl.problem.head_dim == p.head_dim
             and pl.causal == p.causal]
    if not plans:
        r["err"] = "no plan"; rows.append(r); print(r, flush=True); continue
    plan = plans[-1]
    qd, kd, vd = (t.detach() for t in (q, k, v))
    o, lse = plan.forward(qd, kd, vd)
    key = next(iter(plan.bwd))
    bl = plan.bwd[key]
    hop = bl.hopper
    r["cfg"] = str(getattr(bl, "config", None) or "")[:400]
    r["hopper"] = type(hop).__name__ if hop is not None else None
    r["plan_backward"] = issue(lambda: plan.backward(do, qd, kd, vd, o, lse))
    # the python node path
    def py_step():
        for t in (q, k, v): t.grad = None
        out, _ = Attention.apply(plan, q, k, v)
        torch.autograd.backward(out, do)
    py_step(); torch.cuda.synchronize()
    r["py_node_step"] = issue(py_step)
    if hop is not None:
        r["buffers"] = issue(lambda: hop.buffers(qd, kd, vd, lse))
        bufs = hop.buffers(qd, kd, vd, lse)
        r["run"] = issue(lambda: hop.run(do, qd, kd, vd, o, bufs))
        parts = getattr(hop, "parts", [hop])
        h0 = parts[0]
        r["zero_blocks"] = None if h0.zero_blocks is None else len(h0.zero_blocks)
        r["kv_rep"] = h0.kv_rep
        r["frag"] = h0.frag
        if len(parts) == 1:
            dq, dk, dv, lse_, delta, dq_acc, sem = bufs
            r["pre"] = issue(lambda: h0.pre(o, do, delta, dq_acc))
            r["acc_zero"] = issue(lambda: dq_acc.zero_())
            from flashtune.kernels._bound import descriptor_like
            tq, tdo, tk, tv, tacc = h0.templates
            r["desc5"] = issue(lambda: [descriptor_like(t, x) for t, x in zip(h0.templates, (qd, do, kd, vd, dq_acc))])
            rowsd = ((descriptor_like(h0.rows, lse_), descriptor_like(h0.rows, delta)) if h0.rows is not None else (lse_, delta))
            args = (descriptor_like(tq, qd), descriptor_like(tdo, do), descriptor_like(tk, kd),
                    descriptor_like(tv, vd), *rowsd, descriptor_like(tacc, dq_acc), dk, dv, sem)
            r["main_launch"] = issue(lambda: h0.main(*args))
            r["finish"] = issue(lambda: h0.finish(dq_acc, dq))
    # cProfile of plan.backward on the main thread
    pr = cProfile.Profile()
    for _ in range(4):
        gpu_wait(100.0)
        pr.enable()
        for _ in range(25):
            plan.backward(do, qd, kd, vd, o, lse)
        pr.disable()
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    prof_txt.write(f"\n===== {r['problem']} tottime (100 calls)\n" + s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    prof_txt.write(f"\n===== {r['problem']} cumulative\n" + s.getvalue())
    rows.append(r)
    print(json.dumps(r), flush=True)
    del q, k, v, do, o, lse
    torch.cuda.empty_cache()
open(os.path.join(OUT, "host_prof.json"), "w").write(json.dumps(rows, indent=1))
open(os.path.join(OUT, "host_prof.txt"), "w").write(prof_txt.getvalue())
for r in rows:
    print(r["problem"], r.get("hopper"), "step", r["step_issue"], "fwd", r["fwd_issue"], "plan.bwd", r.get("plan_backward"),
          "py", r.get("py_node_step"), "buf", r.get("buffers"), "run", r.get("run"), "main", r.get("main_launch"))
