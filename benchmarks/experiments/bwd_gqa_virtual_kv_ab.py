"""Shipped GQA Hopper backward entries with virtual KV heads, beside the tree, on an sm90 GPU.

``bwd_gqa_virtual_kv.patch`` (applied to a module copy, not to the tree) lets the launch
split each KV head into ``FT_KV_REP`` virtual ones: r programs per (key tile, KV head),
each loading the same K and V tiles and walking GQA / r of the group's query heads, each
writing its dK and dV to its own slice of a partial buffer that is summed (fp32, in a
fixed order) after the kernel. The programs are r times shorter, so a causal grid's tail
of heavy key tiles is too. For each entry index (into the shipped layer), with the entry's
config: the tree, the copy with r = 2 and r = 4 (where the group divides), and cuDNN's
backward, interleaved (``flashtune.timing.time_interleaved``); for each of ours its errors
against the fp32 reference under the 2x rule and whether two calls give the same bits.

    git apply benchmarks/experiments/bwd_gqa_virtual_kv.patch
    cp flashtune/kernels/attn_bwd_hopper.py /tmp/virtual_kv.py && git checkout flashtune
    FLASHTUNE_DB=/nonexistent/d/x.db PYTHONPATH=$PWD:$PWD/benchmarks:$PWD/benchmarks/experiments \\
        python3 benchmarks/experiments/bwd_gqa_virtual_kv_ab.py /tmp/virtual_kv.py out.json \\
        59,57,58,70,60
"""

from __future__ import annotations

import argparse
import json
import os


def main(copy_path: str, out_path: str, indices: list[int]) -> None:
    import hopper_bwd_ab as hab
    import torch

    from flashtune.kernels.config import config_from_dict
    from flashtune.kernels.reference import reference_errors, within_rule
    from flashtune.problem import Problem
    from flashtune.timing import time_interleaved

    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                           "data", "shipped.json")
    entries = json.load(open(shipped))["entries"]
    tree, copy = hab.load("tree", None), hab.load("copy", copy_path)
    rows = []
    for idx in indices:
        e = entries[idx]
        p, cfg = Problem.from_dict(e["example"]), config_from_dict("bwd", e["config"])
        det = e["problem"].get("deterministic", True)
        b, hq, hk, s, d, causal = p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.head_dim, \
            p.causal
        if tuple(p.window) != (-1, -1) or p.seqlen_k != s or p.total_q or p.softcap:
            # The inputs here are dense, Sq = Sk, causal or not: any other problem
            # would be timed as another one under the entry's config.
            print(f"entry {idx}: {p} has a window, Sq != Sk, packed tokens or a softcap; "
                  "skipped", flush=True)
            continue
        gen = torch.Generator(device="cuda").manual_seed(idx)
        fns, (do, qd, kd, vd, o, lse), _, scale = hab.call_inputs(b, hq, hk, s, d, causal, gen)
        checks = {}
        for name, mod, rep in (("tree", tree, 1), ("rep2", copy, 2), ("rep4", copy, 4)):
            if (hq // hk) % rep:
                continue
            os.environ["FT_KV_REP"] = str(rep)  # read when the copy's launch is built
            grads, fns[name] = hab.prepared(mod, do, qd, kd, vd, o, lse, cfg, causal,
                                            (-1, -1), 0.0, scale, det)
            fns[name]()
            torch.cuda.synchronize()
            first = tuple(t.clone() for t in grads)
            errs, torch_errs = reference_errors(qd, kd, vd, do, o, lse, first, causal=causal,
                                                softmax_scale=scale, window_size=(-1, -1),
                                                softcap=0.0)
            ok, worst, detail = within_rule({t: errs[t] for t in ("dq", "dk", "dv")},
                                            torch_errs)
            fns[name]()
            torch.cuda.synchronize()
            checks[name] = dict(ok=ok, worst=worst, detail=detail, bit_identical=all(
                torch.equal(a, c) for a, c in zip(first, grads, strict=True)))
        os.environ["FT_KV_REP"] = "1"
        ms = {n: t.median_ms for n, t in zip(fns, time_interleaved(list(fns.values()),
                                                                    rounds=3), strict=True)}
        rows.append(dict(index=idx, shape=[b, hq, hk, s, d], causal=causal, det=det, ms=ms,
                         checks=checks))
        print(f"{idx} {b}x{hq}/{hk}x{s}x{d}{' causal' if causal else ''}"
              f"{'' if det else ' free'}: cuDNN {ms['cudnn']:.3f} ms | cudnn/x "
              + " ".join(f"{n} {ms['cudnn'] / ms[n]:.3f}" for n in ms if n != "cudnn")
              + " | " + " ".join(f"{n} 2x-rule {'ok' if c['ok'] else 'FAIL'} ({c['worst']:.2f}),"
                                 f" same bits {c['bit_identical']}" for n, c in checks.items()),
              flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("copy", help="the patched module copy")
    ap.add_argument("out", help="JSON to write")
    ap.add_argument("entries", help="comma-separated indices into the shipped layer")
    args = ap.parse_args()
    main(args.copy, args.out, [int(x) for x in args.entries.split(",")])
