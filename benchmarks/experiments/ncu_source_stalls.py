"""Where a warp-specialized kernel's warps wait, from ncu's per-instruction stall sampling.

Input: the SASS source page of an ncu report, as CSV (gzip allowed), made on the GPU host:

    ncu --section SourceCounters --section WarpStateStats --import-source no \\
        --kernel-name regex:_attn_bwd_hopper_kernel --launch-skip 2 --launch-count 1 \\
        -o rep python3 benchmarks/experiments/ncu_bwd.py det128
    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > src_det128.csv.gz

Output: the kernel cut into its partitions (at each ``USETMAXREG``, the register budget a
partition sets on entry), each partition's share of the samples by kind of instruction,
and every mbarrier wait (``SYNCS.PHASECHK``, with the branch that retries it) by barrier
address. Session 28's three profiles are in ``benchmarks/data/ncu_src_s28/``.

    python benchmarks/experiments/ncu_source_stalls.py benchmarks/data/ncu_src_s28/src_det128.csv.gz
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import defaultdict

KINDS = (  # first match wins
    ("named barrier", re.compile(r"\bBAR\.SYNC")),
    ("wgmma wait", re.compile(r"WARPGROUP\.DEPBAR")),
    ("wgmma issue", re.compile(r"\bHGMMA|WARPGROUP\.ARRIVE")),
    ("fence", re.compile(r"\bFENCE|\bMEMBAR")),
    ("local memory", re.compile(r"\b(LDL|STL)\b")),
    ("shared memory", re.compile(r"\b(LDS|STS|LDSM|STSM)\b")),
    ("global memory", re.compile(r"\b(LDG|STG|ATOMG|REDG)\b")),
    ("exp2 / mufu", re.compile(r"\bMUFU")),
)


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.reader(f) if len(r) > 3]
    return rows[0], rows[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--min-pct", type=float, default=0.2,
                    help="list mbarrier waits with at least this share of all samples")
    args = ap.parse_args()
    header, body = read(args.csv)
    src = header.index("Source")
    samples = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    executed = header.index("Instructions Executed")
    total = sum(_num(r[samples]) for r in body) or 1.0

    # Partitions start where a USETMAXREG sets a budget; name each by the first one.
    part, parts = "prologue", []
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    waits: dict[str, list[tuple[str, float, str]]] = defaultdict(list)
    for i, r in enumerate(body):
        text = r[src]
        if "USETMAXREG" in text:
            part = f"{i}: {text.strip()}"
            parts.append(part)
        pct = 100.0 * _num(r[samples]) / total
        prev = body[i - 1][src] if i else ""
        if "PHASECHK" in text or "PHASECHK" in prev:
            kind = "mbarrier wait"
            line = text if "PHASECHK" in text else prev
            bar = re.search(r"\[([^\]]*)\]", line)
            addr = bar.group(1).split("+")[-1] if bar else "?"
            waits[addr].append((part, pct, r[executed]))
        else:
            kind = next((k for k, rx in KINDS if rx.search(text)), "other")
        kinds[part][kind] += pct

    print(f"{len(body)} instructions, {total:.0f} samples")
    for p in ["prologue", *parts]:
        share = sum(kinds[p].values())
        if share < 0.5:
            continue
        cells = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds[p].items(), key=lambda x: -x[1])
                          if v >= 0.1)
        print(f"[{p}] {share:.1f}% of samples: {cells}")
    print("mbarrier waits (barrier address: partition, % of all samples, times executed):")
    for addr, rows in sorted(waits.items()):
        hot = [(p, v, n) for p, v, n in rows if v >= args.min_pct]
        for p, v, n in hot:
            print(f"  {addr}: {v:.1f}% in [{p}], executed {n}")


if __name__ == "__main__":
    main()
