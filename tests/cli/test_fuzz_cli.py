"""CLI fuzzing: bad arguments, shapes files, bench documents and special files.

Every case must end in a clean rejection: exit status 1 (one ``Error:`` line) or 2 (click's
usage error), no traceback, no hang (each case runs under a deadline), and the database
file unchanged. Nothing here launches a kernel: the inputs are refused before that.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.cli import main
from flashtune.db import open_storage
from tests.db import _data

PROBLEM = ["--batch", "1", "--heads", "2", "--seqlen", "16", "--head-dim", "16"]
BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e400", "99999999999999999999", "", "x",
               "0x10", " ", "NaN", "-0"]


def _tune_cases() -> list[list[str]]:
    cases: list[list[str]] = []
    for opt in ("--time-budget", "--trial-timeout"):
        cases += [["tune", *PROBLEM, opt, v] for v in BAD_NUMBERS]
    for opt in ("--trials", "--patience"):
        cases += [["tune", *PROBLEM, opt, v] for v in ("0", "-1", "1.5", "nan", "1e3",
                                                       "99999999999999999999", "")]
    cases += [["tune", *PROBLEM, "--seed", v] for v in ("-1", str(2**32), str(2**64), "1.0",
                                                         "nan", "")]
    base = dict(zip(PROBLEM[::2], PROBLEM[1::2], strict=True))
    for opt, vals in {"--batch": ["0", "-1", str(2**31), "1.5", "nan"],
                      "--heads": ["0", "-2", str(2**40)],
                      "--kv-heads": ["0", "3", "-1"],
                      "--seqlen": ["0", "-5", "1" + "0" * 22],
                      "--seqlen-k": ["0", str(2**31)],
                      "--head-dim": ["7", "0", "12", "264", "512", "-16", "16.0"]}.items():
        for v in vals:
            kw = {**base, opt: v}
            cases.append(["tune", *[x for kv in kw.items() for x in kv]])
    cases += [["tune", *PROBLEM, "--softcap", v] for v in ("nan", "inf", "-1", "x")]
    cases += [["tune", *PROBLEM, "--window", *w] for w in (("-2", "0"), ("0", "-5"),
                                                           ("a", "b"), ("1.5", "0"))]
    cases += [["tune", *PROBLEM, "--dtype", v] for v in ("fp32", "float16", "")]
    cases += [["tune", *PROBLEM, "--direction", v] for v in ("up", "", "FWD")]
    cases += [["tune", *PROBLEM, "--compile-workers", v] for v in ("-1", "nan", str(10**9))]
    return cases


def _sweep_cases() -> list[list[str]]:
    cases = [["sweep", "--gpus", v] for v in ("0,,1", ",", "", "a", "0,0", "-1", "1.5",
                                              "0;1", "０")]
    cases += [["sweep", "--lease", v] for v in ("nan", "inf", "0", "-1", "0.5", "1e9")]
    cases += [["sweep", "--trials", v] for v in ("0", "99999999999999999999", "nan")]
    cases += [["sweep", "--time-budget", v] for v in ("nan", "inf", "0")]
    cases += [["sweep", "--preset", v] for v in ("nope", "")]
    cases += [["sweep", "--preset", "tiny", "--shapes", "x.json"]]
    cases += [["bench", "--rep-ms", v] for v in ("nan", "inf", "0", "1e9")]
    return cases


def _db_url_cases(tmp: Path) -> list[list[str]]:
    out = []
    for url in ("", " ", str(tmp), "nosuch://x", "sqlite:///" + str(tmp),
                f"sqlite:///{tmp}/x.db?mode=rwc"):
        for cmd in (["show"], ["info"], ["export", "-"], ["report", "--out", str(tmp / "r")]):
            out.append([*cmd, "--db", url])
    return out


def _bench_docs() -> list[Any]:
    row = {"shape": "s", "timing": "fwd", "tflops": {"default": 1.0}}
    return [
        [], 3, "x", None, {"rows": 3}, {"rows": None}, {"rows": [3]}, {"rows": ["a"]},
        {"rows": [{**row, "tflops": None}]}, {"rows": [{**row, "tflops": {"d": "fast"}}]},
        {"rows": [{**row, "tflops": {"d": -1}}]}, {"rows": [{**row, "tflops": {"d": True}}]},
        {"rows": [{k: v for k, v in row.items() if k != "tflops"}]},
        {"rows": [{**row, "timing": "sideways"}]}, {"rows": [{**row, "shape": 7}]},
        {"rows": [row], "device": "H200"}, {"rows": [row], "software": ["a"]},
        {"rows": [row], "interpreter": "yes"}, {"rows": [row], "device": {"name": 5}},
        {"rows": [row], "date": 20261123},
    ]


def _shapes_docs() -> list[Any]:
    ok = {"batch": 1, "heads": 2, "seqlen": 16, "head_dim": 16}
    return [[], {}, 3, "x", None, [3], [{**ok, "seqlen": 10**22}], [{**ok, "seqlen": 0}],
            [{**ok, "head_dim": 7}], [{**ok, "heads": "2"}], [{**ok, "dtype": "fp32"}],
            [{**ok, "window": [1]}], [{**ok, "softcap": -1}], [{**ok, "colour": 1}],
            [{**ok, "kv_heads": 3}], {"shapes": 3}]


def _checksum(path: Path) -> str:
    h = hashlib.sha256()
    for p in (path, path.with_name(path.name + "-wal")):
        h.update(p.read_bytes() if p.exists() else b"")  # an empty WAL is no change
    return h.hexdigest()


def _run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = CliRunner().invoke(main, args, env=env)
    took = time.monotonic() - t0
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        (args, repr(r.exception), r.output[-2000:])
    return r.exit_code, r.output, took


def test_cli_fuzz_rejects_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "t.db"
    with open_storage(str(db)) as s:
        s.put_results(_data.results(7, 3))
    before = _checksum(db)
    monkeypatch.chdir(tmp_path)
    cases: list[list[str]] = []
    cases += [[*a, "--interpret", "--db", str(db)] for a in _tune_cases()]
    cases += [[*a, "--interpret", "--db", str(db)] for a in _sweep_cases()]
    cases += _db_url_cases(tmp_path)
    for i, doc in enumerate(_bench_docs()):
        f = tmp_path / f"bench{i}.json"
        f.write_text(json.dumps(doc))
        cases.append(["report", "--bench", str(f), "--db", str(db), "--out", str(tmp_path / "r")])
    for i, doc in enumerate(_shapes_docs()):
        f = tmp_path / f"shapes{i}.json"
        f.write_text(json.dumps(doc))
        for cmd in ("sweep", "bench"):
            cases.append([cmd, "--interpret", "--shapes", str(f), "--db", str(db)])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for special in ("/dev/zero", "/dev/urandom", str(fifo), str(tmp_path)):
        cases.append(["import", special, "--db", str(db)])
        cases.append(["report", "--bench", special, "--db", str(db)])
        cases.append(["sweep", "--interpret", "--shapes", special, "--db", str(db)])
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: past the 64 MiB cap without writing it
    cases.append(["import", str(big), "--db", str(db)])

    failures = []
    for args in cases:
        code, out, took = _run(args)
        if code not in (1, 2) or "Traceback" in out or took > 30:
            failures.append(f"{args}: exit {code} in {took:.1f}s: {out[-300:]!r}")
        elif code == 1 and not out.strip().splitlines()[-1].startswith("Error: "):
            failures.append(f"{args}: {out[-300:]!r}")
        if _checksum(db) != before:
            failures.append(f"{args}: the database changed")
            before = _checksum(db)
    assert not failures, "\n".join(failures[:20])
    assert len(cases) > 200, len(cases)


@pytest.mark.parametrize("args, says", [
    (["tune", *PROBLEM, "--head-dim", "7"], "'--head-dim'"),
    (["tune", *PROBLEM, "--time-budget", "nan"], "'--time-budget': 'nan' is not a finite"),
    (["tune", *PROBLEM, "--seed", "-1"], "'--seed'"),
    (["tune", "--batch", "1", "--heads", "3", "--kv-heads", "2", "--seqlen", "16",
      "--head-dim", "16"], "--heads 3 must be a multiple of --kv-heads 2"),
    (["sweep", "--gpus", "0,,1"], "--gpus"),
    (["sweep", "--lease", "nan"], "'--lease'"),
])
def test_messages_name_the_option_typed(args: list[str], says: str, tmp_path: Path) -> None:
    code, out, _ = _run([*args, "--interpret", "--db", str(tmp_path / "x.db")])
    assert code == 2 and says in out, out


def test_sqlite_mode_ro_is_honoured(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    with open_storage(str(db)) as s:
        doc = json.loads(__import__("flashtune.db.exchange", fromlist=["x"]).export_json(s))
    doc["entries"] = [__import__("flashtune.db.validation", fromlist=["x"]).to_entry(r)
                      for r in _data.results(8, 2)]
    f = tmp_path / "e.json"
    f.write_text(json.dumps(doc))
    before = _checksum(db)
    code, out, _ = _run(["import", str(f), "--db", f"sqlite:///{db}?mode=ro"])
    assert code == 1 and "read-only" in out and _checksum(db) == before


def test_export_takes_the_umask(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    open_storage(str(db)).close()
    old = os.umask(0o027)
    try:
        code, _, _ = _run(["export", str(tmp_path / "e.json"), "--db", str(db)])
    finally:
        os.umask(old)
    assert code == 0 and (tmp_path / "e.json").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("cmd", [
    ["tune", "--interpret", "--batch", "1", "--heads", "2", "--seqlen", "32", "--head-dim",
     "32", "--dtype", "fp16", "--direction", "fwd", "--trials", "1"],
    ["sweep", "--interpret", "--preset", "tiny", "--direction", "fwd", "--trials", "1"],
])
def test_a_read_only_url_is_refused_before_anything_is_written(tmp_path: Path,
                                                              cmd: list[str]) -> None:
    """SQLite's mode=ro is honoured: Optuna, which ignores it, never gets to write."""
    db = tmp_path / "t.db"
    open_storage(str(db)).close()
    before = _checksum(db)
    code, out, _ = _run([*cmd, "--db", f"sqlite:///{db}?mode=ro"])
    assert code == 1 and "read-only" in out and "Traceback" not in out, out
    assert _checksum(db) == before
