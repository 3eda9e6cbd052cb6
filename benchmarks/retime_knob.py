"""Each shipped entry of this GPU (backward, or forward with ``--direction fwd``) against
itself with knobs changed, as the tuner would measure the pair, and the winners written back
into the shipped layer.

On the GPU (``--set``; ``--part i/n`` takes every n-th entry, for one process per GPU):
for each shipped entry of this device's name and direction whose config the changed knobs
apply to (the kernel variant that has them, ``--min-bh`` batch x KV heads, ``--masked``:
causal or windowed problems only, ``--unmasked`` the others, ``--max-keys``, ``--entries``:
indices into the layer), the candidate goes through the tuner's measurement (first launch,
the gate against the fp32 reference, a timing), then the entry's config and the candidate
are timed against each other in one interleaved loop (``measure.retime``, the house
protocol: L2 flushed before every call, clocks meeting both alike). One JSON row per entry.
``--jobs`` runs several such knob sets in one process (a list of runs); ``--tuned`` takes
the knobs from a ``flashtune tune --json`` result (what a fresh search found for one
entry's problem, timed here beside the entry's config); ``--from-device`` each entry's key
as another GPU's shipped entry holds it (one run per entry: the H100's entries, last
searched in session 33, against the H200's with the knobs that landed since);
``--from-budget`` the winners of short searches that beat the shipped entries of their
keys (``tune_autotuner.py budget --against-shipped``), each beside its entry.

    python3 benchmarks/retime_knob.py --set hopper_split=2 --out retime.json
    python3 benchmarks/retime_knob.py --jobs '[["58,59", {"hopper_walk": 0}]]' --out r.json
    python3 benchmarks/retime_knob.py --direction fwd --tuned tune.json --entries 82 \\
        --out r82.json
    python3 benchmarks/retime_knob.py --from-device "NVIDIA H200" --out from_h200.json
    python3 benchmarks/retime_knob.py --from-budget budget.json --out wins.json

Here (``--apply``): the rows whose candidate passed the gate and ran at least
``--min-gain`` faster replace their entries' configs in ``flashtune/data/shipped.json``
(where several runs won on one entry, the fastest candidate), and scale their stored
timings by the candidate's time ratio in the shared loop, where the entry is
still the one that was timed (same device, key and config; the kernel hash of the tree
that ran on the GPU must be the entry's), written as ``autotune export`` writes it.

    python3 benchmarks/retime_knob.py --apply retime.json [retime2.json] --min-gain 0.005
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flashtune", "data",
                       "shipped.json")


def parse_range(spec: str) -> list[int]:
    """Indices from ``spec``, comma-separated numbers and inclusive ranges: "27-56,58"."""
    out: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def knob_values(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def device_jobs(entries: list[dict[str, Any]], here: str, other: str, direction: str,
                only: set[int] | None = None) -> list[tuple[str, dict[str, int]]]:
    """One job per entry of device ``here`` (and ``direction``; ``only``: these indices)
    whose key device ``other`` also holds with another config: that config, as the
    knobs that differ (the fields its kernel variant uses; a whole config where the
    variant differs). Keys ``other`` lacks, or holds with the same config, get none."""
    theirs = {json.dumps(e["problem"], sort_keys=True): e["config"] for e in entries
              if e["direction"] == direction and e["device"]["name"] == other}
    jobs = []
    for index, e in enumerate(entries):
        if e["direction"] != direction or e["device"]["name"] != here \
                or (only is not None and index not in only):
            continue
        cfg = theirs.get(json.dumps(e["problem"], sort_keys=True))
        if cfg is None:
            continue
        knobs = differing_knobs(e["config"], cfg, direction)
        if knobs:
            jobs.append((str(index), knobs))
    return jobs


def differing_knobs(mine: dict[str, Any], cfg: dict[str, Any], direction: str
                    ) -> dict[str, int]:
    """``cfg`` as the knobs that differ from ``mine``: the fields its kernel variant uses,
    or the whole config where the variant differs (retime_entries then takes it whole)."""
    from flashtune.kernels.config import BwdConfig, FwdConfig, active_fields

    cls = FwdConfig if direction == "fwd" else BwdConfig
    fields = cfg if cfg.get("variant") != mine.get("variant") else \
        active_fields(cls, cfg.get("variant"))
    return {k: cfg[k] for k in fields if k in cfg and mine.get(k) != cfg[k]}


def budget_jobs(rows: list[dict[str, Any]], entries: list[dict[str, Any]], here: str,
                direction: str, max_gap: float) -> list[tuple[str, dict[str, int]]]:
    """One job per row of ``tune_autotuner.py budget --against-shipped`` files (``rows``)
    whose short search's winner ran at least ``-max_gap`` faster than the shipped config
    of its key on device ``here`` (``gap`` <= ``max_gap``): the winner, as the knobs that
    differ from that entry. A row's problem is its label (``B16 H32 S1024 D64 causal
    nondet``), matched to the entry by the problem key (determinism included)."""
    from flashtune.problem import ProblemKey

    label_problem = _sibling("tune_autotuner").problem_of_label
    index = {ProblemKey.from_dict({**e["problem"], "direction": e["direction"]}): i
             for i, e in enumerate(entries)
             if e["direction"] == direction and e["device"]["name"] == here}
    jobs = []
    for r in rows:
        if r.get("direction") != direction or r.get("gap") is None or r["gap"] > max_gap:
            continue
        i = index.get(label_problem(r["problem"]).key(direction))
        if i is None:
            print(f"{r['problem']}: no shipped {direction} entry on {here} (skipped)",
                  flush=True)
            continue
        knobs = differing_knobs(entries[i]["config"], r["short_config"], direction)
        if knobs and (str(i), knobs) not in jobs:
            jobs.append((str(i), knobs))
    return jobs


def _sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def retime_entries(knobs: dict[str, int], part: tuple[int, int], min_bh: int,
                   rounds: int, out_path: str, masked: bool = False,
                   unmasked: bool = False, max_keys: int = 0,
                   only: set[int] | None = None, direction: str = "bwd") -> None:
    import torch

    from flashtune.autotune.measure import Bench, measure, retime
    from flashtune.db.fingerprint import software_info
    from flashtune.exceptions import InfeasibleConfigError
    from flashtune.kernels.config import active_fields, check, config_from_dict
    from flashtune.problem import Problem

    name = torch.cuda.get_device_name()
    sw = software_info().for_direction(direction)
    entries = json.load(open(SHIPPED))["entries"]
    mine = [(i, e) for i, e in enumerate(entries)
            if e["direction"] == direction and e["device"]["name"] == name
            and (only is None or i in only)]
    i_part, n_part = part
    mine = mine[i_part - 1::n_part]
    out: dict[str, Any] = {"device": name, "direction": direction,
                           "software": dataclasses.asdict(sw), "set": knobs,
                           "torch": torch.__version__, "rows": []}
    for index, e in mine:
        cfg = config_from_dict(direction, e["config"])
        p = Problem.from_dict(e["example"])
        row: dict[str, Any] = {"index": index, "key": e["problem"], "example": e["example"],
                               "config": e["config"], "software": e["software"]}
        # A kernel variant without these knobs (a knob set with "variant" is a whole other
        # config: the check below judges it).
        if "variant" not in knobs and not set(knobs) <= set(active_fields(type(cfg),
                                                                          cfg.variant)):
            continue
        if p.batch * p.heads_kv < min_bh:
            continue
        if masked and not (p.causal or tuple(p.window) != (-1, -1)):
            continue  # a knob of masked calls only
        if unmasked and (p.causal or tuple(p.window) != (-1, -1)):
            continue  # a knob of unmasked calls only (hopper_persist)
        if max_keys and p.seqlen_k > max_keys:
            continue
        cand = dataclasses.replace(cfg, **knobs)
        try:
            check(cand, p)
        except InfeasibleConfigError as err:
            row["status"] = f"infeasible: {err}"
            out["rows"].append(row)
            continue
        t0 = time.perf_counter()
        bench = Bench(p, "cuda")
        m = measure(bench, direction, cand, seed=0)
        row.update(status=m.status, max_error=m.max_error, gate_ratio=m.ratio,
                   detail=m.detail)
        if m.status == "ok":
            base, new = retime(bench, direction, [cfg, cand], rounds=rounds)
            row.update(entry_ms=[base.median_ms, base.p20_ms, base.p80_ms],
                       candidate_ms=[new.median_ms, new.p20_ms, new.p80_ms],
                       speedup=base.median_ms / new.median_ms)
        row["seconds"] = time.perf_counter() - t0
        out["rows"].append(row)
        b, h = p.batch, p.heads_q
        print(f"{index:3} {b}x{h}/{p.heads_kv}x{p.seqlen_q}x{p.head_dim}"
              f"{' causal' if p.causal else ''}{'' if p.deterministic else ' nondet'}: "
              f"{m.status} " + (f"{row['speedup']:.3f}x" if "speedup" in row else ""),
              flush=True)
        del bench
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


def apply(paths: list[str], min_gain: float) -> None:
    from flashtune.db import open_storage
    from flashtune.db.exchange import export_json, import_json
    from flashtune.db.fingerprint import software_info
    from flashtune.kernels.config import config_from_dict, config_to_dict
    from flashtune.problem import Problem

    data = json.load(open(SHIPPED))
    entries = data["entries"]
    # Every winning row of every run (a file holds one run, or a list of them: --jobs),
    # fastest first: where two runs won on one entry, the faster candidate is taken.
    wins = []
    for path in paths:
        loaded = json.load(open(path))
        for run in loaded if isinstance(loaded, list) else [loaded]:
            direction = run.get("direction", "bwd")  # (files before --direction: backward)
            here = dataclasses.asdict(software_info().for_direction(direction))
            if run["software"]["kernels_hash"] != here["kernels_hash"]:
                raise SystemExit(f"{path}: timed with kernel hash "
                                 f"{run['software']['kernels_hash']}, this tree's is "
                                 f"{here['kernels_hash']}")
            wins += [(row, run, direction, here) for row in run["rows"]
                     if row.get("status") == "ok" and row["speedup"] >= 1.0 + min_gain]
    wins.sort(key=lambda w: -w[0]["speedup"])
    changed, taken = 0, set()
    for row, run, direction, here in wins:
        key = (direction, run["device"], json.dumps(row["key"], sort_keys=True))
        if key in taken:
            print(f"entry {row['index']}: {row['speedup']:.3f}x with {run['set']} "
                  "(a faster candidate taken)")
            continue
        taken.add(key)
        # The entry timed (its index may have moved since: a relabel re-exports).
        timed = config_from_dict(direction, row["config"])  # (knobs added since: defaults)
        found = [e for e in entries if e["direction"] == direction
                 and e["device"]["name"] == run["device"] and e["problem"] == row["key"]
                 and config_from_dict(direction, e["config"]) == timed]
        if len(found) != 1:
            raise SystemExit(f"the entry timed as {row['index']} is not in the shipped "
                             "layer (once) any more")
        e = found[0]
        if e["software"]["kernels_hash"] != here["kernels_hash"]:
            raise SystemExit(f"entry {row['index']}: kernel hash "
                             f"{e['software']['kernels_hash']} is not this tree's "
                             "(relabel the shipped layer first)")
        # The entry's figures (the sweep's anchored timing) times the candidate's
        # ratio to the entry's config in the shared loop: a loop of two heavy
        # launches alone runs the GPU hotter than the sweep's and the bench's (their
        # absolute figures 0-11% above the stored ones on the H200, session 54), so
        # its ratio is kept, not its milliseconds.
        r = row["candidate_ms"][0] / row["entry_ms"][0]
        med, p20, p80 = (e[f] * r for f in ("median_ms", "p20_ms", "p80_ms"))
        p = Problem.from_dict(e["example"])
        e["config"] = config_to_dict(dataclasses.replace(timed, **run["set"]))
        e.update(median_ms=med, p20_ms=p20, p80_ms=p80, max_error=row["max_error"],
                 tflops=p.flops(direction) / (med * 1e9), trials=e["trials"] + 1,
                 search_seconds=e["search_seconds"] + row["seconds"])
        changed += 1
        print(f"entry {row['index']}: {row['speedup']:.3f}x with {run['set']}")
    # Written as `autotune export` writes it: through an in-memory database.
    with open_storage("sqlite://") as st:
        import_json(st, json.dumps(data).encode())
        out = export_json(st)
    with open(SHIPPED, "wb") as f:
        f.write(out)
    print(f"{changed} entries changed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], help="knob=value (repeatable)")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--part", default="1/1")
    ap.add_argument("--min-bh", type=int, default=1, help="least batch x KV heads")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--masked", action="store_true",
                      help="only entries of causal or windowed problems")
    mask.add_argument("--unmasked", action="store_true",
                      help="only calls without a causal mask or window")
    ap.add_argument("--max-keys", type=int, default=0, help="only calls of at most this many "
                    "keys (0: any)")
    ap.add_argument("--entries", default=None, help="only these indices into the shipped "
                    "layer, e.g. 27-56,58 (default: all of this GPU's)")
    ap.add_argument("--jobs", default=None, metavar="JSON",
                    help='several runs in one process instead of --set: a list of '
                    '[entries, {knob: value}], e.g. \'[["58,59", {"hopper_walk": 0}]]\'; '
                    "--out gets the list of their results")
    ap.add_argument("--tuned", default=None, metavar="FILE",
                    help="instead of --set: the config of a `tune --json` result for "
                    "--direction, as the knobs that differ from the --entries entry's")
    ap.add_argument("--from-device", default=None, metavar="NAME",
                    help="instead of --set: each entry against the config the shipped "
                    "entry of device NAME (as torch names it) holds for the same key")
    ap.add_argument("--from-budget", nargs="+", default=None, metavar="FILE",
                    help="instead of --set: each short-search winner of these "
                    "`tune_autotuner.py budget --against-shipped` files that beat its key's "
                    "entry by --max-gap, against that entry")
    ap.add_argument("--max-gap", type=float, default=-0.008,
                    help="--from-budget: the rows whose gap is at most this (default -0.008)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--apply", nargs="+", help="result files to write into the shipped layer")
    ap.add_argument("--min-gain", type=float, default=0.005)
    args = ap.parse_args()
    if args.apply:
        apply(args.apply, args.min_gain)
        return
    if not (args.set or args.jobs or args.tuned or args.from_device or args.from_budget) \
            or not args.out:
        ap.error("--set, --jobs, --tuned, --from-device or --from-budget, and --out "
                 "(or --apply)")
    i, n = (int(x) for x in args.part.split("/"))
    only = set(parse_range(args.entries)) if args.entries else None
    if args.tuned:
        if only is None or len(only) != 1:
            ap.error("--tuned needs --entries with one index")
        entry = json.load(open(SHIPPED))["entries"][min(only)]
        found = json.load(open(args.tuned))[args.direction]["config"]
        knobs = {k: v for k, v in found.items() if entry["config"].get(k) != v}
        print(f"entry {min(only)}: the tuned config differs in {knobs}", flush=True)
        jobs = [(args.entries, knobs)] if knobs else []
    elif args.jobs:
        jobs = [(spec, knobs) for spec, knobs in json.loads(args.jobs)]
    elif args.from_budget:
        import torch

        rows = [r for path in args.from_budget for r in json.load(open(path))["rows"]]
        jobs = budget_jobs(rows, json.load(open(SHIPPED))["entries"],
                           torch.cuda.get_device_name(), args.direction, args.max_gap)
        print(f"{len(jobs)} short-search winners beat their entries by "
              f"{-args.max_gap:.1%} or more", flush=True)
        jobs, i, n = jobs[i - 1::n], 1, 1  # one entry per run: --part takes every n-th
    elif args.from_device:
        import torch

        jobs = device_jobs(json.load(open(SHIPPED))["entries"], torch.cuda.get_device_name(),
                           args.from_device, args.direction, only)
        print(f"{len(jobs)} entries hold another config on {args.from_device}", flush=True)
        # One entry per run: --part takes every n-th run (one process per GPU).
        jobs, i, n = jobs[i - 1::n], 1, 1
    else:
        retime_entries(knob_values(args.set), (i, n), args.min_bh, args.rounds, args.out,
                       args.masked, args.unmasked, args.max_keys, only, args.direction)
        return
    runs = []
    for spec, knobs in jobs:
        retime_entries(knobs, (i, n), args.min_bh, args.rounds, args.out + ".part",
                       args.masked, args.unmasked, args.max_keys, set(parse_range(spec)),
                       args.direction)
        runs.append(json.load(open(args.out + ".part")))
        with open(args.out, "w") as f:  # after every run, so that a timeout keeps them
            json.dump(runs, f, indent=1)
    if os.path.exists(args.out + ".part"):
        os.remove(args.out + ".part")


if __name__ == "__main__":
    main()
