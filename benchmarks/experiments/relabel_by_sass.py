"""Relabel forward and backward entries to the running tree's hashes where their machine code
is proved unchanged; leave the others stale.

``relabel_bwd_hash.py`` handles one old hash and the backward only. Session 34's change
(the Hopper backward's flat GQA walk, and ``BwdConfig.hopper_walk`` in ``config.py``, which
the forward's hash covers too) left entries under three hashes: the forward's, the
backward's before the walk, and the backward's of the first walk commit (the entries
re-searched on it). This takes, per old hash, the SASS fingerprints of the export's entries
built on the tree those entries were tuned on, and the fingerprints of the same entries
built on the running tree (``bwd_ptx_identity.py --sass --direction both``, all on the same
file, so that the entry indices agree), and rewrites ``software.kernels_hash`` to the
running tree's hash of the entry's direction wherever the two agree. (PTX fingerprints, the
script's default, serve as well and better: since session 38 they are built fresh and
compare two trees at two paths, while the ptxas of Triton 3.6 does not always schedule one
PTX the same way twice.) An entry whose
fingerprints differ keeps its old hash (stale, never served; ``autotune sweep --from-stale``
re-tunes it on its device from its winner). Entries already under the running tree's
hashes are left alone; an entry under an old hash without fingerprints stops the run.

    python benchmarks/experiments/relabel_by_sass.py flashtune/data/shipped.json \\
        --before 7b0a12c3...=fp_old.json --before a733ecee...=fp_mid.json \\
        --before c92f89b9...=fp_old.json --after fp_new.json
"""

from __future__ import annotations

import argparse
import json
import sys

from flashtune.db import open_storage
from flashtune.db.exchange import export_json, import_json
from flashtune.db.fingerprint import software_info


def label(e: dict) -> str:
    x = e["example"]
    return (f"{e['direction']} {e['device']['name']} {x['batch']}x{x['heads_q']}/"
            f"{x['heads_kv']}x{x['seqlen_q']}x{x['head_dim']}{' causal' if x['causal'] else ''}"
            f" variant {e['config'].get('variant')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--before", action="append", default=[], required=True,
                    help="OLD_HASH=fingerprints.json, taken on the tree of that hash")
    ap.add_argument("--after", required=True, help="fingerprints on the running tree")
    args = ap.parse_args()
    now = software_info()
    new = {"fwd": now.fwd_kernels_hash, "bwd": now.kernels_hash}
    before: dict[str, dict] = {}
    for spec in args.before:
        old, _, path = spec.partition("=")
        with open(path) as f:
            before[old] = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    with open(args.path) as f:
        doc = json.load(f)
    relabelled, differ = [], []
    for i, e in enumerate(doc["entries"]):
        sw = e["software"]
        if sw["kernels_hash"] == new[e["direction"]]:
            continue
        fps = before.get(sw["kernels_hash"])
        if fps is None:
            sys.exit(f"entry {i} ({label(e)}) carries {sw['kernels_hash'][:12]}, for which no "
                     "--before fingerprints were given: nothing relabelled")
        if not fps.get(str(i)) or not after.get(str(i)):
            sys.exit(f"no fingerprints for entry {i} ({label(e)}): run bwd_ptx_identity.py on "
                     "this very file: nothing relabelled")
        if fps[str(i)] == after[str(i)]:
            relabelled.append((i, sw["kernels_hash"]))
        else:
            differ.append(i)
    for i, _ in relabelled:
        e = doc["entries"][i]
        e["software"]["kernels_hash"] = new[e["direction"]]
    # Written as `autotune export` writes it: through an in-memory database.
    with open_storage("sqlite://") as st:
        import_json(st, json.dumps(doc).encode())
        data = export_json(st)
    with open(args.path, "wb") as f:
        f.write(data)
    by_old: dict[str, int] = {}
    for _, old in relabelled:
        by_old[old[:12]] = by_old.get(old[:12], 0) + 1
    print(f"relabelled {len(relabelled)} entries of {args.path} to fwd {new['fwd'][:12]} / "
          f"bwd {new['bwd'][:12]} (from {by_old}); left stale: {len(differ)}")
    for i in differ:
        print(f"  stale: {label(doc['entries'][i])}")


if __name__ == "__main__":
    main()
