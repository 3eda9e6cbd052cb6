"""``autotune report``: one PNG and one HTML page about one device's tuning.

- **Ratio view** (with ``--bench``): for each problem, the tuned kernel's TFLOP/s over each
  other implementation's (the untuned default, cuDNN, FA2, Flex, ...), training forward and
  backward, as a heatmap with the geomean of each column in its header. Every number comes
  from one ``autotune bench`` run, which re-times every implementation in one process.
  Without ``--bench``: the tuned TFLOP/s stored for each problem, sorted.
- **Search progress**: for each Optuna study of the device, the speed-up of the best config
  found so far over the default config, which the search times first.
- The HTML embeds the PNG, its caption, the ratio numbers and each winning config.

The device is explicit: ``--device`` (a fingerprint or part of a name), by default this
machine's. Both files are written atomically; matplotlib runs headless (Agg).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from flashtune.cli._common import clean_errors, db_option, read_input, write_atomically

ANCHORS = {"default": "default", "cudnn": "cuDNN", "fa2": "FA2", "flex": "Flex"}
TIMINGS = {"fwd": "train fwd", "bwd": "bwd", "infer": "infer fwd"}


@dataclass
class Device:
    """The device a report is about: ``text`` as given (or this machine's fingerprint)."""

    text: str
    name: str

    def matches(self, info: Any) -> bool:
        return bool(info.matches(self.text))


@dataclass
class Data:
    device: Device
    results: list[Any]  # the tuned results stored for the device (fresh ones)
    curves: list[dict[str, Any]]
    bench: dict[str, Any] | None = None
    interpreter: bool = False
    rows: list[str] = field(default_factory=list)  # ratio view: one label per problem
    columns: list[tuple[str, str]] = field(default_factory=list)  # (timing, anchor)
    ratios: list[list[float]] = field(default_factory=list)  # rows x columns
    geomeans: list[float] = field(default_factory=list)


def _device(text: str | None) -> Device:
    from flashtune.db.fingerprint import device_info

    if text is None:
        here = device_info()
        return Device(here.fingerprint, here.name)
    return Device(text, text)


def _curves(url: str, device: Device) -> list[dict[str, Any]]:
    """Per study of ``device``: the speed-up over the default config of the best config
    measured so far, by measured trial (studies whose default was not measured: none)."""
    import optuna
    from optuna.trial import TrialState

    from flashtune.db.fingerprint import DeviceInfo
    from flashtune.problem import Problem

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = _study_storage(url)
    if storage is None:
        return []
    out = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if not summary.study_name.startswith("flashtune/") or "problem" not in attrs:
            continue
        try:
            if not device.matches(DeviceInfo(**attrs["device"])):
                continue
            problem = Problem.from_dict(attrs["problem"])
        except (TypeError, ValueError, KeyError):
            continue  # a study this flashtune did not write
        trials = storage.get_all_trials(storage.get_study_id_from_name(summary.study_name),
                                        deepcopy=False)
        done = [t for t in trials if t.user_attrs.get("measured")]
        base = [t.value for t in done if t.user_attrs.get("seed_source") == "default"
                and t.state == TrialState.COMPLETE and t.value]
        if not base:
            continue
        best, ys = math.inf, []
        for t in done:
            if t.state == TrialState.COMPLETE and t.value:
                best = min(best, t.value)
            ys.append(base[0] / best if best < math.inf else float("nan"))
        direction = summary.study_name.split("/")[1]
        out.append({"study": summary.study_name, "direction": direction,
                    "label": f"{direction} {problem.label()}", "speedup": ys,
                    "interpreter": bool(attrs.get("interpreter"))})
    return out


def _study_storage(url: str) -> Any:
    """Optuna's storage over ``url``, opened to read; None when the database or Optuna's
    tables do not exist. A report creates neither, and opens a SQLite file read-only
    (Optuna itself would ignore ``mode=ro`` in the URL and create its tables)."""
    from urllib.parse import quote

    import optuna
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from flashtune.db import open_storage
    from flashtune.exceptions import DatabaseMissingError

    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database in (None, "", ":memory:"):
        return None  # a new in-memory database: no studies
    try:
        with open_storage(url, read_only=True) as st, st.engine.connect() as conn:
            if not inspect(conn).has_table("studies"):
                return None
    except DatabaseMissingError:
        return None
    if u.get_backend_name() == "sqlite":
        url = f"sqlite:///file:{quote(str(Path(str(u.database)).absolute()))}?mode=ro&uri=true"
    return optuna.storages.RDBStorage(url, skip_table_creation=True)


def _stored(url: str, device: Device) -> list[Any]:
    from flashtune.db import open_storage
    from flashtune.exceptions import DatabaseMissingError

    try:
        with open_storage(url, read_only=True) as st:
            found = st.results(include_stale=False)
    except DatabaseMissingError:
        return []
    return [r for r in found if device.matches(r.device)]


def _ratio_view(data: Data) -> None:
    """Fill the ratio view from the bench document: tuned over each anchor, per problem."""
    from flashtune.timing import geomean

    assert data.bench is not None
    rows = [r for r in data.bench["rows"] if r["timing"] in ("fwd", "bwd")]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    present = {(r["timing"], n) for r in rows for n in r["tflops"] if n != "tuned"}
    data.columns = [(t, a) for t in ("fwd", "bwd") for a in ANCHORS if (t, a) in present]
    by = {(r["shape"], r["timing"]): r["tflops"] for r in rows}
    nan = float("nan")
    data.rows = shapes
    for shape in shapes:
        line = []
        for timing, anchor in data.columns:
            tf = by.get((shape, timing), {})
            ours, theirs = tf.get("tuned", nan), tf.get(anchor, nan)
            line.append(ours / theirs if theirs and theirs > 0 else nan)
        data.ratios.append(line)
    data.geomeans = [geomean([row[j] for row in data.ratios]) for j in range(len(data.columns))]


def collect(db_url: str | None, *, bench: dict[str, Any] | None = None,
            device: str | None = None) -> Data:
    """Everything the report shows, read from the database (and the bench document).

    The device: ``device`` if given, else the one the bench document was measured on, else
    this machine. A bench document of another device than ``device`` is refused."""
    from flashtune.db import resolve_url

    url = resolve_url(db_url)
    measured_on = str((bench or {}).get("device", {}).get("name") or "")
    if bench is not None and device is not None and measured_on \
            and device.lower() not in measured_on.lower():
        raise click.ClickException(
            f"the bench file was measured on {measured_on!r}, not on {device!r}; pass the "
            "--device it was measured on, or another bench file")
    dev = _device(device if device is not None or not measured_on else measured_on)
    data = Data(dev, _stored(url, dev), _curves(url, dev), bench)
    names = {r.device.name for r in data.results}
    if len(names) == 1:  # the device's full name, as stored
        dev.name = names.pop()
    if bench is not None:
        _ratio_view(data)
    data.interpreter = bool(bench and bench.get("interpreter")) or any(
        r.device.capability == "cpu" for r in data.results) or (
        not data.results and any(c["interpreter"] for c in data.curves))
    return data


def caption(data: Data) -> str:
    if data.columns:
        when = (data.bench or {}).get("date", "?")
        return ("Ratio view: TFLOP/s of the tuned config over each implementation, per problem "
                "(> 1: tuned is faster; grey: not measured; header: geomean over the problems "
                "measured). All of them were "
                f"re-timed in one `autotune bench` process ({when}) by the house protocol. "
                "Search progress: the best config so far over the default config, both as the "
                "tuner timed them during its search. Those search timings differ from the "
                "re-timing by a few percent (another process and moment), so the ratio view "
                "uses only the re-timed numbers; the HTML lists both.")
    return ("Tuned TFLOP/s: the winning config as the tuner timed it during its search, one "
            "number per problem. For ratios against the default and the SDPA/Flex anchors, "
            "all re-timed in one process, run `autotune bench --json` and pass --bench. "
            "Search progress: the best config so far over the default config, timed by the "
            "tuner.")


def _heatmap(ax: Any, fig: Any, data: Data) -> None:
    import numpy as np

    vals = np.array(data.ratios, dtype=float)
    shown = np.log2(np.clip(vals, 1 / 4, 4))
    im = ax.imshow(np.ma.masked_invalid(shown), cmap="RdYlGn", vmin=-1, vmax=1, aspect="auto")
    ax.set_facecolor("#dddddd")  # no measurement
    for (i, j), v in np.ndenumerate(vals):
        if v == v:
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(data.rows)), [_plain(r) for r in data.rows], fontsize=8)
    ax.set_xticks(range(len(data.columns)),
                  [f"{TIMINGS[t]}\nvs {ANCHORS[a]}\ngeomean\n{g:.2f}x"
                   for (t, a), g in zip(data.columns, data.geomeans, strict=True)], fontsize=8)
    ax.xaxis.tick_top()
    for j in range(1, len(data.columns)):  # a white rule between forward and backward
        if data.columns[j][0] != data.columns[j - 1][0]:
            ax.axvline(j - 0.5, color="white", linewidth=4)
    bar = fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01, ticks=[-1, -0.5, 0, 0.5, 1])
    bar.ax.set_yticklabels(["0.5x", "0.71x", "1x", "1.41x", "2x"], fontsize=8)
    ax.set_title("tuned over each implementation (TFLOP/s ratio, re-timed together)",
                 fontsize=10, pad=8)


def _bars(ax: Any, data: Data) -> None:
    rs = sorted(data.results, key=lambda r: (r.median_ms if data.interpreter else -r.tflops))
    xs = [r.median_ms if data.interpreter else r.tflops for r in rs]
    labels = [_plain(f"{r.key.direction} {r.problem.label() if r.problem else r.key.short()}")
              for r in rs]
    ax.barh(range(len(rs)), xs, color="#4c72b0")
    ax.set_yticks(range(len(rs)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, x in enumerate(xs):
        ax.text(x, i, f" {x:.3g}", va="center", fontsize=7)
    what = "median ms (interpreter timings)" if data.interpreter else "TFLOP/s"
    ax.set_xlabel(what)
    ax.set_title(f"tuned {what} per problem, as stored by the search", fontsize=10)
    if not rs:
        ax.text(0.5, 0.5, f"no tuned results for {data.device.name}", ha="center",
                va="center", transform=ax.transAxes)


def _progress(ax: Any, data: Data) -> None:
    import numpy as np

    colors = {"fwd": "#4c72b0", "bwd": "#dd8452"}
    for direction, color in colors.items():
        cs = [c["speedup"] for c in data.curves if c["direction"] == direction]
        for ys in cs:
            ax.plot(range(1, len(ys) + 1), ys, color=color, alpha=0.3, linewidth=0.8)
        if cs:
            n = max(len(ys) for ys in cs)
            grid = np.array([ys + [ys[-1]] * (n - len(ys)) for ys in cs], dtype=float)
            ax.plot(range(1, n + 1), np.nanmedian(grid, axis=0), color=color, linewidth=2.5,
                    label=f"{direction}: median of {len(cs)} studies (thin: each study)")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("measured trials")
    ax.set_ylabel("speed-up over the default config")
    ax.set_title("search progress: best config so far", fontsize=10)
    if data.curves:
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no tuning studies with a measured default", ha="center",
                va="center", transform=ax.transAxes)


def draw(data: Data) -> bytes:
    """The report's PNG: the ratio view (or stored TFLOP/s), search progress, a caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = len(data.rows) if data.columns else len(data.results)
    top = max(2.5, 0.28 * n + 1.5)
    fig = plt.figure(figsize=(12, top + 6.2), layout="constrained")
    grid = fig.add_gridspec(3, 1, height_ratios=[top, 4.6, 0.6])
    ax1, ax2, foot = (fig.add_subplot(grid[i]) for i in range(3))
    if data.columns:
        _heatmap(ax1, fig, data)
    else:
        _bars(ax1, data)
    _progress(ax2, data)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    foot.axis("off")
    foot.text(0, 1, caption(data), va="top", ha="left", fontsize=8.5, wrap=True,
              transform=foot.transAxes)
    kind = " (interpreter timings: not GPU numbers)" if data.interpreter else ""
    fig.suptitle(_plain(f"flashtune report: {data.device.name}{kind}"), fontsize=13)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def build(db_url: str | None, out_dir: Path, *, bench: dict[str, Any] | None = None,
          device: str | None = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``out_dir``; returns their paths."""
    from flashtune.db import resolve_url

    data = collect(db_url, bench=bench, device=device)
    png_bytes = draw(data)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / "report.png", out_dir / "report.html"
    write_atomically(png, png_bytes)
    write_atomically(page, _html(png_bytes, data, resolve_url(db_url)).encode())
    return png, page


def _html(png: bytes, data: Data, url: str) -> str:
    from flashtune.cli._common import where

    e = html.escape
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    meta = f"device {e(data.device.name)}; database {e(where(url))}; generated {e(when)}"
    if data.bench:
        sw = data.bench.get("software", {})
        meta += (f"; bench: torch {e(str(sw.get('torch')))}, triton "
                 f"{e(str(sw.get('triton')))}, {e(str(data.bench.get('date')))}")
    ratios = ""
    if data.columns:
        head = "".join(f"<th>{e(TIMINGS[t])} vs {e(ANCHORS[a])}</th>" for t, a in data.columns)
        body = "".join(f"<tr><td>{e(r)}</td>" + "".join(_cell(v) for v in vs) + "</tr>"
                       for r, vs in zip(data.rows, data.ratios, strict=True))
        body += "<tr><th>geomean</th>" + "".join(_cell(g) for g in data.geomeans) + "</tr>"
        ratios = (f"<h2>Tuned over each implementation (re-timed together)</h2>"
                  f"<table><tr><th>problem</th>{head}</tr>{body}</table>")
    unit = "TFLOP/s (interpreter: meaningless)" if data.interpreter else "TFLOP/s"
    entries = "".join(
        f'<tr class="entry"><td>{e(r.key.direction)}</td><td>{e(r.key.short())}</td>'
        f"<td>{e(r.problem.label() if r.problem else '-')}</td>{_cell(r.median_ms, '.4g')}"
        f"{_cell(r.tflops)}<td>{r.trials}</td><td><code>"
        + e(" ".join(f"{k}={v}" for k, v in sorted(r.config.items()))) + "</code></td></tr>"
        for r in data.results)
    studies = "".join(f"<tr><td>{e(c['label'])}</td><td>{len(c['speedup'])}</td>"
                      f"{_cell(c['speedup'][-1])}</tr>" for c in data.curves)
    img = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>flashtune report: {e(data.device.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}
code{{font-size:85%}}</style></head><body>
<h1>flashtune report</h1><p>{meta}</p>
<img alt="ratio view and search progress" src="data:image/png;base64,{img}">
<p>{e(caption(data))}</p>
{ratios}
<h2>Winning configs ({len(data.results)}), as the search stored them</h2>
<table><tr><th>dir</th><th>problem key</th><th>example shape</th><th>median ms</th>
<th>{e(unit)}</th><th>trials</th><th>config</th></tr>{entries}</table>
<h2>Searches ({len(data.curves)})</h2>
<table><tr><th>problem</th><th>measured trials</th><th>speed-up over default</th></tr>{studies}
</table></body></html>
"""


def _cell(v: float, spec: str = ".3g") -> str:
    return f"<td>{v:{spec}}</td>" if v == v else "<td>-</td>"


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
              help="The device to report on: a fingerprint or part of its name (default: "
                   "the one the --bench file was measured on, else this machine).")
@db_option
def report(out_dir: str, bench_file: str | None, device: str | None,
           db_url: str | None) -> None:
    """Draw one device's tuning: tuned over the default and the anchors (with --bench),
    search progress as speed-up over the default, and each winning config (HTML)."""
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
