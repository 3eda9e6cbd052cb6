"""Relabel backward entries of an export to the running tree's kernels hash, where a change
is proved not to have touched their generated code.

A backward result is stored under the hash of every kernel source (``kernels_hash``): a
host-side edit in a kernel module (a launcher, a docstring) makes every backward entry
stale, although the kernels they were tuned on still run unchanged. Given the PTX
fingerprints of every backward entry built on the tree before and after the change
(``bwd_ptx_identity.py``, run on both trees from the same path with Triton 3.6, so that line
info and file names compare too), this rewrites ``software.kernels_hash`` from ``--old`` to
the running tree's hash on the backward entries only, and only if:

- both fingerprint files cover exactly the export's backward entries (by index: run it on
  the file the fingerprints were taken from) and agree on each one;
- the running tree's forward hash is unchanged (forward entries are not touched).

With ``--only-identical`` the entries whose fingerprints differ are left as they are, under
the old hash: stale, never served, and what ``autotune sweep --from-stale`` re-tunes on
their device starting from their winners (session 34: the flat GQA walk changed the
Hopper backward's code for GQA problems only; its fingerprints are of the SASS,
``bwd_ptx_identity.py --sass``).

    python benchmarks/experiments/relabel_bwd_hash.py flashtune/data/shipped.json \\
        --old a703171cb9fe... --before ptx_before.json --after ptx_after.json
"""

from __future__ import annotations

import argparse
import json
import sys

from flashtune.db import open_storage
from flashtune.db.exchange import export_json, import_json
from flashtune.db.fingerprint import software_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--old", required=True, help="the kernels hash the entries carry")
    ap.add_argument("--before", required=True, help="PTX fingerprints on the old tree")
    ap.add_argument("--after", required=True, help="PTX fingerprints on the running tree")
    ap.add_argument("--only-identical", action="store_true",
                    help="relabel the entries whose fingerprints agree; leave the rest stale")
    args = ap.parse_args()
    now = software_info()
    with open(args.path) as f:
        doc = json.load(f)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    bwd = [str(i) for i, e in enumerate(doc["entries"]) if e["direction"] == "bwd"]
    # The fingerprints are keyed by entry index: the export must be the file they were
    # taken from, in its order (every fingerprinted index a backward entry of it).
    if set(before) != set(bwd) or set(after) != set(bwd):
        sys.exit("the fingerprints are not of this file's backward entries (another file, or "
                 "reordered): nothing relabelled")
    missing = [i for i in bwd if i not in before or i not in after or not before[i]]
    if missing:
        sys.exit(f"no fingerprints for backward entries {missing[:8]}: nothing relabelled")
    differ = [i for i in bwd if before[i] != after[i]]
    if differ and not args.only_identical:
        sys.exit(f"the PTX of backward entries {differ[:8]} changed: nothing relabelled")
    fwd_hashes = {e["software"]["kernels_hash"] for e in doc["entries"]
                  if e["direction"] == "fwd"}
    if fwd_hashes - {now.fwd_kernels_hash}:
        sys.exit("forward entries carry another forward hash than the running tree's: "
                 "nothing relabelled")
    n = 0
    for i in bwd:
        if i in differ:
            continue
        sw = doc["entries"][int(i)]["software"]
        if sw["kernels_hash"] == args.old:
            sw["kernels_hash"] = now.kernels_hash
            n += 1
    # Written as `autotune export` writes it (its order follows the hash): through an
    # in-memory database, so the file stays a canonical export.
    with open_storage("sqlite://") as st:
        import_json(st, json.dumps(doc).encode())
        data = export_json(st)
    with open(args.path, "wb") as f:
        f.write(data)
    print(f"relabelled {n} of {len(bwd)} backward entries of {args.path} "
          f"({args.old[:12]} -> {now.kernels_hash[:12]}); left stale: {len(differ)}")
    for i in differ:
        e = doc["entries"][int(i)]
        x = e["example"]
        print(f"  stale: {e['device']['name']} {x['batch']}x{x['heads_q']}/{x['heads_kv']}x"
              f"{x['seqlen_q']}x{x['head_dim']}{' causal' if x['causal'] else ''} "
              f"variant {e['config']['variant']}")


if __name__ == "__main__":
    main()
