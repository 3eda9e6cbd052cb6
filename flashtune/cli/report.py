"""``autotune report``: one PNG and one HTML page from the tuning database.

Two panels:
- TFLOP/s per shape for each implementation: from an ``autotune bench --json`` document
  when given (tuned, default, SDPA backends, FlexAttention), else the tuned results
  stored in the database.
- Tuning progress: for each Optuna study in the database, the best TFLOP/s found so far
  against the number of measured trials.

The HTML embeds the PNG and lists the numbers behind it. Both files are written
atomically. matplotlib runs headless (Agg).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from flashtune.cli._common import clean_errors, db_option, read_input, write_atomically


def _curves(url: str, device: str | None) -> list[dict[str, Any]]:
    """Best-so-far TFLOP/s per measured trial of every flashtune study in ``url``."""
    import optuna
    from optuna.trial import TrialState

    from flashtune.autotune.study import optuna_storage
    from flashtune.problem import Problem

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna_storage(url)
    out = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if not summary.study_name.startswith("flashtune/") or "problem" not in attrs:
            continue
        dev = attrs.get("device", {}).get("name", "?")
        if device is not None and device.lower() not in dev.lower():
            continue
        direction = summary.study_name.split("/")[1]
        problem = Problem.from_dict(attrs["problem"])
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        best = math.inf
        xs: list[int] = []
        ys: list[float] = []
        for t in study.get_trials(deepcopy=False):
            if not t.user_attrs.get("measured"):
                continue
            if t.state == TrialState.COMPLETE and t.value is not None:
                best = min(best, t.value)
            xs.append(len(xs) + 1)
            ys.append(problem.flops(direction) / (best * 1e-3) / 1e12 if best < math.inf
                      else float("nan"))
        if xs:
            label = (f"{direction} {problem.dtype} {problem.dims()}"
                     f"{' causal' if problem.causal else ''}")
            out.append({"study": summary.study_name, "label": label, "device": dev,
                        "interpreter": bool(attrs.get("interpreter")), "trials": xs,
                        "best_tflops": ys})
    return out


def _bars_from_db(url: str, device: str | None) -> tuple[list[str], dict[str, list[float]]]:
    from flashtune.db import open_storage
    from flashtune.exceptions import DatabaseMissingError

    try:
        with open_storage(url, read_only=True) as st:
            results = st.results(device=device, include_stale=False)
    except DatabaseMissingError:
        results = []
    labels = [f"{r.device.name}: {r.key.short()}" for r in results]
    return labels, {"tuned": [r.tflops for r in results]}


def _bars_from_bench(doc: dict[str, Any]) -> tuple[list[str], dict[str, list[float]]]:
    rows = [r for r in doc["rows"] if r.get("timing") in ("fwd", "bwd")]
    labels = [f"{r['shape']} {r['timing']}" for r in rows]
    impls = [n for n in ("tuned", "default", "cudnn", "fa2", "efficient", "flex")
             if any(n in r["tflops"] for r in rows)]
    return labels, {n: [r["tflops"].get(n, float("nan")) for r in rows] for n in impls}


def build(db_url: str | None, out_dir: Path, *, bench: dict[str, Any] | None = None,
          device: str | None = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from flashtune.db import resolve_url

    url = resolve_url(db_url)
    labels, series = _bars_from_bench(bench) if bench else _bars_from_db(url, device)
    curves = _curves(url, device)
    interp = bool(bench and bench.get("interpreter")) or any(c["interpreter"] for c in curves)
    unit = "TFLOP/s (interpreter timings)" if interp else "TFLOP/s"

    n = max(len(labels), 1)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10.0, 0.45 * n + 4), 11),
                                   gridspec_kw={"height_ratios": [3, 2]})
    width = 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        ax1.bar([x + i * width for x in range(len(labels))], ys, width, label=_plain(name))
    ax1.set_xticks([x + (len(series) - 1) * width / 2 for x in range(len(labels))])
    ax1.set_xticklabels([_plain(x) for x in labels], rotation=60, ha="right", fontsize=7)
    ax1.set_ylabel(unit)
    source = "autotune bench" if bench else "tuned results in the database"
    ax1.set_title(f"TFLOP/s per shape ({source})")
    if not labels:
        ax1.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax1.transAxes)
    elif series:
        ax1.legend(fontsize=8)
    for c in curves:
        ax2.plot(c["trials"], c["best_tflops"], marker=".", linewidth=1,
                 label=_plain(c["label"]))
    ax2.set_xlabel("measured trials")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel(f"best {unit}")
    ax2.set_title("tuning progress (best so far, per study)")
    if curves and len(curves) <= 16:
        ax2.legend(fontsize=7)
    elif not curves:
        ax2.text(0.5, 0.5, "no tuning studies", ha="center", va="center",
                 transform=ax2.transAxes)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    png_bytes = buf.getvalue()

    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / "report.png", out_dir / "report.html"
    write_atomically(png, png_bytes)
    write_atomically(page, _html(png_bytes, labels, series, curves, unit, bench, url).encode())
    for f in (png, page):  # a report is for reading: the temp file's 0600 is too strict
        f.chmod(0o644)
    return png, page


def _html(png: bytes, labels: list[str], series: dict[str, list[float]],
          curves: list[dict[str, Any]], unit: str, bench: dict[str, Any] | None,
          url: str) -> str:
    from sqlalchemy.engine import make_url

    e = html.escape
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    where = make_url(url).render_as_string(hide_password=True)
    meta = f"database {e(where)}; generated {e(when)}"
    if bench:
        dev = bench.get("device", {}).get("name", "?")
        sw = bench.get("software", {})
        meta += (f"; bench on {e(str(dev))} (torch {e(str(sw.get('torch')))}, triton "
                 f"{e(str(sw.get('triton')))}) at {e(str(bench.get('date')))}")
    head = "".join(f"<th>{e(n)}</th>" for n in series)
    rows = "".join(
        "<tr><td>" + e(lab) + "</td>"
        + "".join(f"<td>{v:.3g}</td>" if v == v else "<td>-</td>" for v in
                  (series[n][i] for n in series)) + "</tr>"
        for i, lab in enumerate(labels))
    crow = "".join(f"<tr><td>{e(c['label'])}</td><td>{e(c['device'])}</td>"
                   f"<td>{len(c['trials'])}</td><td>{c['best_tflops'][-1]:.3g}</td></tr>"
                   for c in curves)
    img = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>flashtune report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}
</style></head><body>
<h1>flashtune report</h1><p>{meta}</p>
<img alt="TFLOP/s per shape and tuning progress" src="data:image/png;base64,{img}">
<h2>{e(unit)} per shape</h2>
<table><tr><th>shape</th>{head}</tr>{rows}</table>
<h2>Tuning studies</h2>
<table><tr><th>problem</th><th>device</th><th>trials</th><th>best {e(unit)}</th></tr>{crow}</table>
</body></html>
"""


def _plain(text: str) -> str:
    """A label matplotlib draws as it is: ``$`` would start mathtext (and a device name such
    as ``$\\frac`` would end the report in a parse error)."""
    return str(text).replace("$", r"\$")


_TIMINGS = ("fwd", "bwd", "infer")


def validate_bench(doc: Any) -> dict[str, Any]:
    """Check an ``autotune bench --json`` document; ValueError naming the first bad field."""
    def number(v: Any, where: str) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ValueError(f"{where}: expected a finite number >= 0, got {v!r:.60}")

    if not isinstance(doc, dict):
        raise ValueError(f"expected an object, got {type(doc).__name__}")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"rows: expected an array, got {type(rows).__name__}")
    for name, kind in (("device", dict), ("software", dict), ("interpreter", bool),
                       ("date", str)):
        if name in doc and not isinstance(doc[name], kind):
            raise ValueError(f"{name}: expected {kind.__name__}, got {type(doc[name]).__name__}")
    if isinstance(doc.get("device"), dict) and not isinstance(doc["device"].get("name", ""), str):
        raise ValueError("device.name: expected a string")
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        if not isinstance(row.get("shape"), str):
            raise ValueError(f"{where}.shape: expected a string")
        if row.get("timing") not in _TIMINGS:
            raise ValueError(f"{where}.timing: expected one of {', '.join(_TIMINGS)}")
        tf = row.get("tflops")
        if not isinstance(tf, dict):
            raise ValueError(f"{where}.tflops: expected an object of implementation: TFLOP/s")
        for name, v in tf.items():
            number(v, f"{where}.tflops.{name}")
    return doc


@click.command("report")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="flashtune-report",
              show_default=True, help="Folder for report.png and report.html.")
@click.option("--bench", "bench_file", type=click.Path(exists=True, dir_okay=False),
              default=None, metavar="FILE",
              help="`autotune bench --json` output: TFLOP/s of every implementation.")
@click.option("--device", default=None, metavar="TEXT",
              help="Only this device: a fingerprint or part of its name.")
@db_option
def report(out_dir: str, bench_file: str | None, device: str | None,
           db_url: str | None) -> None:
    """Draw TFLOP/s per shape for each implementation and the tuning progress curves."""
    with clean_errors():
        bench_doc = None
        if bench_file:
            try:
                bench_doc = validate_bench(json.loads(read_input(bench_file, "a bench file")))
            except ValueError as e:
                raise click.ClickException(
                    f"{bench_file}: not `autotune bench --json` output ({e})") from None
        png, html = build(db_url, Path(out_dir), bench=bench_doc, device=device)
    click.echo(f"wrote {png} and {html}")
