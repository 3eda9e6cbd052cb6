"""Each study's fastest search trial against the time its final re-timing stored.

A sweep's database keeps each search's Optuna study: its trials' medians (the search's
adaptive timing, one config at a time) and the ``winner`` the final interleaved re-timing
crowned, with the median it stored. This prints, per study, the fastest trial's median,
the stored median and their ratio, worst first, and the median ratio per direction. No
GPU: it reads a database a sweep wrote.

    python benchmarks/experiments/retime_vs_trials.py ship_h200.db [--top 12]
"""

from __future__ import annotations

import argparse
import statistics

import optuna


def rows(url: str) -> list[tuple[str, str, float, float]]:
    """(direction, problem slug, fastest trial ms, stored ms) per study with a winner."""
    out = []
    for summary in optuna.get_all_study_summaries(url):
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        winner = study.user_attrs.get("winner")
        times = [t.value for t in study.trials if t.value is not None]
        if not isinstance(winner, dict) or "median_ms" not in winner or not times:
            continue
        parts = summary.study_name.split("/")
        out.append((parts[1], parts[-1], min(times), float(winner["median_ms"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db", help="a SQLite database file a sweep wrote")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    found = sorted(rows(f"sqlite:///{args.db}"), key=lambda r: r[3] / r[2], reverse=True)
    print(f"{'dir':4} {'problem':40} {'trial ms':>9} {'stored ms':>9} {'ratio':>6}")
    for d, slug, trial, stored in found[:args.top]:
        print(f"{d:4} {slug:40} {trial:9.4f} {stored:9.4f} {stored / trial:6.3f}")
    for d in ("fwd", "bwd"):
        ratios = [r[3] / r[2] for r in found if r[0] == d]
        if ratios:
            print(f"{d}: {len(ratios)} studies, median stored/trial {statistics.median(ratios):.3f}, "
                  f"above 1.1: {sum(x > 1.1 for x in ratios)}, above 1.3: "
                  f"{sum(x > 1.3 for x in ratios)}")


if __name__ == "__main__":
    main()
