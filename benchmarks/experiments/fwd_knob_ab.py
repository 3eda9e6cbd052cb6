"""A Hopper forward knob A/B (issue 12): the shipped config and the default, each with
``--knob`` at each of ``--values`` (or with each of ``--variants``' sets of fields), judged,
then timed beside cuDNN.

Session 40 ran it for ``exp2_fma`` (one in every N of the softmax's exponentials computed by
a polynomial on the FMA units instead of MUFU.EX2; ``fwd_exp2_fma.patch``, not landed: it
was slower), for ``pingpong`` (slower) and, with ``--variants``, for three consumer
warpgroups on the unmasked D=64 rows (faster from S=2048); BENCHMARKS.md, issue 12.

For each shape of the standard matrix (``--head-dims``, ``--causal`` and the sequence
bounds narrow it), the shipped config for this GPU and the heuristic default are run with
each set of fields, the first set the baseline. Each variant is first judged under the 2x
rule against the fp32 reference on the tuner's gate inputs
(``autotune.measure.gate_problem``), and its O and LSE on the timing inputs are compared
with the baseline's (``vs_first``; session 40's JSON calls it ``vs_mufu``); then the
variants that pass are timed in one interleaved loop beside cuDNN (the inference forward,
through ``flash_attention`` with the config forced; house protocol). Prints cuDNN / ours
per variant, and writes JSON.

    git apply benchmarks/experiments/fwd_exp2_fma.patch   # the knob below is the patch's
    timeout -k 10 400 python3 benchmarks/experiments/fwd_knob_ab.py --knob exp2_fma \
        --values 0,2,4,8 --head-dims 64 --bases shipped --out $OUT/exp2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

from flashtune.kernels.config import UNVERIFIED_ENV

os.environ.setdefault(UNVERIFIED_ENV, "1")  # the knob under test (config.REFUSED_KNOBS)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import _label, environment  # noqa: E402
from fwd_tile_end_ab import beside_cudnn  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.autotune.measure import gate_problem  # noqa: E402
from flashtune.kernels.attention import flash_attention  # noqa: E402
from flashtune.kernels.config import HOPPER, default_fwd, is_feasible  # noqa: E402
from flashtune.kernels.reference import GateCase  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import make_inputs, standard_matrix  # noqa: E402


def variants(p: Problem, bases: tuple[str, ...], sets: dict[str, dict[str, int]],
             ) -> dict[str, dict[str, Any]]:
    """{base: {name: config with the fields of sets[name]}} for the shipped config and the
    default (where it differs), each where it is feasible; the first set is the baseline."""
    out: dict[str, dict[str, Any]] = {}
    first = next(iter(sets))
    for name, c in (("shipped", shipped_config(p, torch.cuda.get_device_name())),
                    ("default", default_fwd(p))):
        if name not in bases or c is None or c.variant != HOPPER:
            continue
        got = {n: dataclasses.replace(c, **fields) for n, fields in sets.items()}
        got = {n: c for n, c in got.items() if is_feasible(c, p)[0]}
        if first not in got or any(v.get(first) == got[first] for v in out.values()):
            continue
        out[name] = got
    return out


def scan(p: Problem, rep_ms: float, bases: tuple[str, ...], sets: dict[str, dict[str, int]],
         ) -> dict[str, Any]:
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(), "bases": {}}
    got = variants(p, bases, sets)
    first = next(iter(sets))
    if not got:
        row["skipped"] = "no Hopper config"
        return row
    gate = GateCase(gate_problem(p), "fwd", device="cuda",
                    generator=torch.Generator().manual_seed(1))
    q, k, v = make_inputs(p, "cuda")
    names: list[str] = []
    fns: list[Any] = []
    for base, cfgs in got.items():
        info: dict[str, Any] = {"config": dataclasses.asdict(cfgs[first]), "gate": {}}
        o0, l0 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=cfgs[first])
        for n, c in cfgs.items():
            cmp = gate.check(c)
            torch.cuda.synchronize()
            info["gate"][n] = {"ok": cmp.ok, "ratio": cmp.ratio, "errors": cmp.errors}
            if n != first:
                o1, l1 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=c)
                fin = torch.isfinite(l0)
                info.setdefault("vs_first", {})[n] = {
                    "o_max_abs": float((o0.float() - o1.float()).abs().max()),
                    "lse_max_abs": float((l0[fin] - l1[fin]).abs().max()) if fin.any() else 0.0,
                    "lse_inf_equal": bool(torch.equal(torch.isinf(l0), torch.isinf(l1)))}
            if not cmp.ok:
                continue  # a wrong output is reported, never timed
            names.append(f"{base}:{n}")
            fns.append(lambda c=c: flash_attention(q, k, v, causal=p.causal, config=c))
        row["bases"][base] = info
    row["ms"] = beside_cudnn(p, (q, k, v), names, fns, rep_ms)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--knob", help="a FwdConfig field, with --values")
    ap.add_argument("--values", help="comma-separated; the first is the baseline")
    ap.add_argument("--variants", help="instead of --knob: 'name:field=v,field=v;...', each "
                                       "applied to the base config; 'base' (unchanged) first")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--min-seq", type=int, default=1)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--bases", default="shipped,default")
    args = ap.parse_args()
    dims = {int(x) for x in args.head_dims.split(",")}
    bases = tuple(args.bases.split(","))
    if args.variants:
        sets: dict[str, dict[str, int]] = {"base": {}}
        for spec in args.variants.split(";"):
            name, fields = spec.split(":")
            sets[name] = {f: int(x) for f, x in (kv.split("=") for kv in fields.split(","))}
    elif args.knob and args.values:
        sets = {x: {args.knob: int(x)} for x in args.values.split(",")}
    else:
        ap.error("give --knob and --values, or --variants")
    doc: dict[str, Any] = {"environment": environment(), "sets": sets, "rows": []}
    for p in standard_matrix():
        if p.head_dim not in dims or not args.min_seq <= p.seqlen_q <= args.max_seq \
                or (args.causal == "yes" and not p.causal) \
                or (args.causal == "no" and p.causal):
            continue
        row = scan(p, args.rep_ms, bases, sets)
        doc["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        ms = row.get("ms", {})
        cu = ms.get("cudnn")
        cells = [f"{n}={cu / t:.3f}" if cu else f"{n}={t:.3f}ms"
                 for n, t in ms.items() if n != "cudnn"]
        bad = [f"{b}:{n}" for b, i in row["bases"].items() for n, g in i["gate"].items()
               if not g["ok"]]
        print(f"{row['label']:<28} " + " ".join(cells) + (f"  FAILED {bad}" if bad else ""),
              flush=True)
    # Geomean of each set's speed over the first's, per base.
    b0, *rest = sets
    for base in bases:
        for n in rest:
            r = [row["ms"][f"{base}:{b0}"] / row["ms"][f"{base}:{n}"] for row in doc["rows"]
                 if f"{base}:{n}" in row.get("ms", {}) and f"{base}:{b0}" in row.get("ms", {})]
            if r:
                g = math.exp(sum(map(math.log, r)) / len(r))
                print(f"{base} {n}: {g:.4f}x over {b0} ({len(r)} shapes, "
                      f"{min(r):.3f}-{max(r):.3f})")


if __name__ == "__main__":
    main()
