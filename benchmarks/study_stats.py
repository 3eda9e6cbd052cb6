"""Where a tuning database's searches spent their trials and their time, read back from
its Optuna studies (no GPU needed).

    python benchmarks/study_stats.py DB [DB ...] [--json OUT]

Per database and direction, over the studies that measured at least two candidates (a
one-trial search had nothing to choose): how many candidates were measured and how many
trials the study holds (the rest are the sampler's infeasible or repeated picks and
cancelled ones, as recorded before the proposer kept those out of the database), where
the measured ones came from (the sampler, a warm-start seed, polishing, recombination),
which source gave each study's fastest trial (by the trials' own timings, before the
final re-timing), and the measured trials' wall time against
the search's own seconds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna


def stats(url: str) -> list[dict[str, Any]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True)
    out = []
    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    for d in ("fwd", "bwd"):
        row: dict[str, Any] = {"direction": d, "studies": 0, "measured": 0, "held": 0,
                               "trial_wall_s": 0.0, "search_s": 0.0}
        by_source: Counter[str] = Counter()
        fastest: Counter[str] = Counter()
        unmeasured: Counter[str] = Counter()
        for s in summaries:
            if not s.study_name.startswith(f"flashtune/{d}/"):
                continue
            study = optuna.load_study(study_name=s.study_name, storage=storage)
            trials = study.get_trials(deepcopy=False)
            measured = [t for t in trials if t.user_attrs.get("measured")]
            if len(measured) < 2:
                continue
            row["studies"] += 1
            row["measured"] += len(measured)
            row["held"] += len(trials)
            for t in trials:
                if t.user_attrs.get("measured"):
                    continue
                kind = ("infeasible" if t.user_attrs.get("stage") == "feasibility"
                        else "repeated" if "duplicate_of" in t.user_attrs
                        else "cancelled" if t.user_attrs.get("cancelled") else "other")
                unmeasured[kind] += 1
            row["trial_wall_s"] += sum(float(t.user_attrs.get("wall_s", 0.0)) for t in measured)
            row["search_s"] += float(study.user_attrs.get("search_seconds", 0.0))
            by_source.update(str(t.user_attrs.get("seed_source", "sampler")) for t in measured)
            ok = [t for t in measured if t.state == optuna.trial.TrialState.COMPLETE]
            if ok:
                best = min(ok, key=lambda t: float(t.value or 0.0))
                fastest[str(best.user_attrs.get("seed_source", "sampler"))] += 1
        row["measured_by_source"] = dict(by_source.most_common())
        row["fastest_by_source"] = dict(fastest.most_common())
        row["unmeasured_trials"] = dict(unmeasured.most_common())
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dbs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = {}
    for db in args.dbs:
        rows = stats(f"sqlite:///{db}")
        result[db.name] = rows
        for r in rows:
            print(f"{db.name} {r['direction']}: {r['studies']} studies, {r['measured']} measured "
                  f"of {r['held']} trials held (the others: {r['unmeasured_trials']}); "
                  f"measured by source {r['measured_by_source']}; "
                  f"fastest by source {r['fastest_by_source']}; measured trials' wall "
                  f"{r['trial_wall_s']:.0f} s of {r['search_s']:.0f} s of search")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
