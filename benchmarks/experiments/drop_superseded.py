"""Drop from an export the stale entries that a fresh entry of the same key supersedes.

After a kernel change, ``relabel_bwd_hash.py --only-identical`` leaves the entries whose
machine code changed under the old hash (stale, never served). Those re-searched on the
new kernels come back from the GPU as fresh entries of the same key and device; imported
beside the stale ones they do not replace them (another software fingerprint is another
row). This keeps a stale entry only where nothing fresh serves its key on its device, so
that ``autotune sweep --from-stale`` on that device can still start from its winner.

    python benchmarks/experiments/drop_superseded.py merged.json flashtune/data/shipped.json
"""

from __future__ import annotations

import argparse
import json

from flashtune.db import open_storage
from flashtune.db.exchange import export_json, import_json
from flashtune.db.fingerprint import software_info
from flashtune.problem import ProblemKey


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args()
    now = software_info()
    fresh_hash = {"fwd": now.fwd_kernels_hash, "bwd": now.kernels_hash}
    with open(args.src) as f:
        doc = json.load(f)

    def where(e: dict) -> tuple:
        key = ProblemKey.from_dict({**e["problem"], "direction": e["direction"]})
        return e["direction"], e["device"]["name"], e["device"].get("sm_count"), key

    fresh = {where(e) for e in doc["entries"]
             if e["software"]["kernels_hash"] == fresh_hash[e["direction"]]}
    kept, dropped = [], []
    for e in doc["entries"]:
        stale = e["software"]["kernels_hash"] != fresh_hash[e["direction"]]
        (dropped if stale and where(e) in fresh else kept).append(e)
    doc["entries"] = kept
    with open_storage("sqlite://") as st:
        import_json(st, json.dumps(doc).encode())
        data = export_json(st)
    with open(args.dst, "wb") as f:
        f.write(data)
    for e in dropped:
        x = e["example"]
        print(f"dropped: {e['direction']} {e['device']['name']} {x['batch']}x{x['heads_q']}/"
              f"{x['heads_kv']}x{x['seqlen_q']}x{x['head_dim']}"
              f"{' causal' if x['causal'] else ''} ({e['software']['kernels_hash'][:12]})")
    stale_left = sum(e["software"]["kernels_hash"] != fresh_hash[e["direction"]] for e in kept)
    print(f"{len(kept)} entries written to {args.dst}, {len(dropped)} dropped, "
          f"{stale_left} stale kept")


if __name__ == "__main__":
    main()
