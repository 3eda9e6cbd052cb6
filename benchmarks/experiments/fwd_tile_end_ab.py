"""The Hopper forward's tile-end knobs A/B (issue 12): ``defer_o`` (a tile's O store waited
for behind the next tile's first product) and ``tile_overlap`` (a tile's last PV and its
end beside the next tile's first QK^T), against the serial consumer.

Session 20's arithmetic put about 5 us per tile on short rows into each tile's serial start
and end. For each shape of the standard matrix (``--min-seq``/``--max-seq`` and ``--bases``
narrow it), the shipped config for this GPU and the heuristic default are timed, each
where it runs a persistent grid with two Q buffers, as is and with each knob that it can
take. The timing is one
interleaved loop beside cuDNN (the inference forward, through ``flash_attention`` with
the config forced; house protocol). Before that, every variant's O and LSE are checked to
equal the serial config's bit for bit. Prints cuDNN / ours per variant and each knob's
gain, and writes JSON.

    timeout -k 10 300 python3 benchmarks/experiments/fwd_tile_end_ab.py --max-seq 2048 \
        --bases shipped --out $OUT/ends.json

A variant whose outputs differ is not timed; its row records where they differ
(``where_differs``). ``--knobs`` picks the knobs, ``--check-only`` skips the timing, so
that one knob's check can run under ``compute-sanitizer`` (session 38: ``tile_overlap``
differed on the first shape and hit an illegal address on the next; session 39 found
there an out-of-range shared address in a QK^T that ptxas 12.8 had built with a Q
descriptor it computed in another branch only, and gave the QK^T one issue site):

    timeout -k 10 500 compute-sanitizer --tool memcheck python3 \
        benchmarks/experiments/fwd_tile_end_ab.py --knobs tile_overlap --check-only \
        --max-seq 512 --out $OUT/overlap.json
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

os.environ.setdefault(UNVERIFIED_ENV, "1")  # the knobs under test (config.REFUSED_KNOBS)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import _label, environment  # noqa: E402
from hopper_fwd_consumers import shipped_config  # noqa: E402

from flashtune.kernels.attention import flash_attention  # noqa: E402
from flashtune.kernels.config import HOPPER, default_fwd, is_feasible  # noqa: E402
from flashtune.problem import Problem  # noqa: E402
from flashtune.timing import anchors, make_inputs, standard_matrix, time_interleaved  # noqa: E402

KNOBS = ["defer_o", "tile_overlap"]  # --knobs narrows it


def where_differs(o0: torch.Tensor, o1: torch.Tensor, l0: torch.Tensor, l1: torch.Tensor,
                  block_m: int) -> dict[str, Any]:
    """Where a variant's O (B, H, S, D) and LSE (B, H, S) leave the serial config's: how
    many (batch, head, row) rows differ in each, the largest O difference, the first such
    row, and the rows' positions within their query tile (``block_m``), to tell a slip at
    a tile's end from one spread over the tile."""
    o_bad = (o0 != o1).any(-1)  # (B, H, S): SDPA's layout, as make_inputs gives
    l_bad = l0 != l1  # +inf (rows that see no key) equals +inf
    bad = o_bad | l_bad
    idx = bad.nonzero()
    out: dict[str, Any] = {"o_rows": int(o_bad.sum()), "lse_rows": int(l_bad.sum()),
                           "rows": int(bad.numel()),
                           "o_max_abs": float((o0.float() - o1.float()).abs().max())}
    if len(idx):
        out["first"] = [int(x) for x in idx[0]]
        within = (idx[:, 2] % block_m).tolist()
        out["within_tile"] = {"min": min(within), "max": max(within)}
        out["tiles"] = len({(b, h, r // block_m) for b, h, r in idx.tolist()})
    return out


def variants(p: Problem, bases: tuple[str, ...] = ("shipped", "default"),
             ) -> dict[str, dict[str, Any]]:
    """{base name: {"off": config, knob: config with it, ...}} for the shipped config and
    the default (where it differs), those of ``bases``, each knob where it can run."""
    out: dict[str, dict[str, Any]] = {}
    for name, c in (("shipped", shipped_config(p, torch.cuda.get_device_name())),
                    ("default", default_fwd(p))):
        if name not in bases or c is None or c.variant != HOPPER:
            continue
        off = dataclasses.replace(c, defer_o=0, tile_overlap=0)
        if any(v["off"] == off for v in out.values()):
            continue
        got = {knob: dataclasses.replace(off, **{knob: 1}) for knob in KNOBS}
        got = {k: c for k, c in got.items() if is_feasible(c, p)[0]}
        if got:
            out[name] = {"off": off, **got}
    return out


def scan(p: Problem, rep_ms: float, bases: tuple[str, ...], timed: bool = True,
         ) -> dict[str, Any]:
    row: dict[str, Any] = {"label": _label(p), "problem": p.as_dict(), "bases": {}}
    got = variants(p, bases)
    if not got:
        row["skipped"] = "no config here runs a persistent grid with two Q buffers"
        return row
    q, k, v = make_inputs(p, "cuda")
    names: list[str] = []
    fns: list[Any] = []
    for base, cfgs in got.items():
        o0, l0 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=cfgs["off"])
        info: dict[str, Any] = {"config": dataclasses.asdict(cfgs["off"]), "bit_identical": {}}
        for tag, c in cfgs.items():
            if tag != "off":
                o1, l1 = flash_attention(q, k, v, causal=p.causal, return_lse=True, config=c)
                torch.cuda.synchronize()  # an illegal address is this variant's, not later
                info["bit_identical"][tag] = bool(torch.equal(o0, o1) and torch.equal(l0, l1))
                if not info["bit_identical"][tag]:
                    info.setdefault("differs", {})[tag] = where_differs(o0, o1, l0, l1,
                                                                        c.block_m)
                    continue  # a wrong output is reported, never timed
            names.append(f"{base}:{tag}")
            fns.append(lambda c=c: flash_attention(q, k, v, causal=p.causal, config=c))
        row["bases"][base] = info
    if not timed:
        return row
    row["ms"] = beside_cudnn(p, (q, k, v), names, fns, rep_ms)
    return row


def beside_cudnn(p: Problem, qkv: tuple[torch.Tensor, ...], names: list[str], fns: list[Any],
                 rep_ms: float) -> dict[str, float]:
    """Median ms of each of ``fns`` (by ``names``) and of cuDNN's forward on the same
    inputs (where SDPA has it), in one interleaved loop (house protocol), no grad."""
    cudnn = anchors(p, ("cudnn",)).get("cudnn")
    names, fns = list(names), list(fns)
    if cudnn is not None:
        names.append("cudnn")
        fns.append(lambda: cudnn(*qkv))
    with torch.no_grad():
        ts = time_interleaved(fns, rep_ms=rep_ms, rounds=3)
    return {n: t.median_ms for n, t in zip(names, ts, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--min-seq", type=int, default=1, help="with --max-seq: one slice")
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--bases", default="shipped,default",
                    help="the configs to vary: shipped, default or both (fewer builds)")
    ap.add_argument("--knobs", default=",".join(KNOBS),
                    help="the knobs to try, comma-separated (default: both)")
    ap.add_argument("--check-only", action="store_true",
                    help="compare outputs only, no timing (say, under compute-sanitizer)")
    args = ap.parse_args()
    KNOBS[:] = [k for k in args.knobs.split(",") if k]
    rows = []
    for p in standard_matrix():
        if not args.min_seq <= p.seqlen_q <= args.max_seq:
            continue
        rows.append(scan(p, args.rep_ms, tuple(args.bases.split(",")), not args.check_only))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps its rows
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    gains: dict[str, list[float]] = {}
    print(f"{'shape':34s} {'base':8s} " + " ".join(f"{'cuDNN/' + t:>18s}"
                                                 for t in ("off", *KNOBS)))
    for r in rows:
        if "skipped" in r:
            print(f"{r['label']:34s} skipped: {r['skipped']}")
            continue
        ms = r.get("ms", {})
        c = ms.get("cudnn", math.nan)
        for base, info in r["bases"].items():
            cells = []
            for tag in ("off", *KNOBS):
                x = ms.get(f"{base}:{tag}")
                if tag != "off" and not info["bit_identical"].get(tag, True):
                    cells.append(f"{'OUTPUT DIFFERS':>18s}")
                elif x is None:
                    cells.append(f"{'-':>18s}")
                else:
                    cells.append(f"{c / x:18.3f}")
                    if tag != "off":
                        gains.setdefault(f"{base}:{tag}", []).append(
                            math.log(ms[f"{base}:off"] / x))
            print(f"{r['label']:34s} {base:8s} " + " ".join(cells))
    for name, g in gains.items():
        print(f"{name}: over the serial config, geomean {math.exp(sum(g) / len(g)):.3f} "
              f"over {len(g)} shapes (min {math.exp(min(g)):.3f}, max {math.exp(max(g)):.3f})")


if __name__ == "__main__":
    main()
