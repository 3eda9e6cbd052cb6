"""Relabel forward entries of an export stored under the whole kernels hash with the forward's own.

Since ad696a2 a forward result is stored under the hash of the forward's sources alone
(``SoftwareInfo.fwd_kernels_hash``) and stays fresh across backward-only changes. Results
written before that carry the hash of all kernel sources, which a backward change makes
stale although the forward's generated code did not change. Given ``--whole H`` and
``--fwd F`` (the two hashes of the tree the entries were tuned on, from
``flashtune.db.fingerprint.software_info()`` at that commit), this rewrites
``software.kernels_hash`` from H to F on the forward entries only, and only if F is also
the forward hash of the running tree (so the forward sources are byte-identical). Nothing
else changes; backward entries keep H and stay stale.

    python benchmarks/experiments/relabel_fwd_hash.py flashtune/data/shipped.json \\
        --whole 8443a08a... --fwd c92f89b9... [--device "NVIDIA H100 80GB HBM3"]
"""

from __future__ import annotations

import argparse
import json
import sys

from flashtune.db.fingerprint import software_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--whole", required=True, help="the whole kernels hash the entries carry")
    ap.add_argument("--fwd", required=True, help="the forward hash of that same tree")
    ap.add_argument("--device", default="", help="only this device's entries")
    args = ap.parse_args()
    now = software_info()
    if now.fwd_kernels_hash != args.fwd:
        sys.exit(f"the running tree's forward hash is {now.fwd_kernels_hash[:12]}, not "
                 f"{args.fwd[:12]}: the forward sources changed, nothing relabelled")
    with open(args.path) as f:
        doc = json.load(f)
    n = 0
    for e in doc["entries"]:
        sw = e["software"]
        if (e["direction"] == "fwd" and sw["kernels_hash"] == args.whole
                and (not args.device or e["device"]["name"] == args.device)):
            sw["kernels_hash"] = args.fwd
            n += 1
    with open(args.path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"relabelled {n} forward entries of {args.path}")


if __name__ == "__main__":
    main()
