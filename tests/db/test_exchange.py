"""Export / import / merge: lossless, byte-stable, validated before anything is written."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from flashtune.db import Storage, open_storage
from flashtune.db.exchange import (
    FORMAT_VERSION,
    export_json,
    import_json,
    shipped_results,
    to_entry,
    validate_export,
)
from flashtune.exceptions import ImportValidationError
from tests.db import _data
from tests.db._data import A100, H200, OLD_SW, SW
from tests.db.conftest import BACKENDS


def doc(results: list[_data.Result]) -> dict[str, Any]:
    return {"format": "flashtune-tuning-db", "format_version": FORMAT_VERSION,
            "entries": [to_entry(r) for r in results]}


def dump(d: Any) -> bytes:
    return json.dumps(d).encode()


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_export_import_is_lossless_and_byte_stable(storage: Storage, tmp_path: Any) -> None:
    rs = _data.results(21, 40)
    storage.put_results(rs)
    first = export_json(storage)
    assert first == export_json(storage)  # two exports of one database: identical bytes
    with open_storage(str(tmp_path / "copy.db")) as copy:
        report = import_json(copy, first)
        assert (report.added, report.replaced, report.kept) == (40, 0, 0)
        assert export_json(copy) == first
        assert copy.results(software=SW) == storage.results(software=SW)
    assert sorted(validate_export(first), key=repr) == sorted(rs, key=repr)


def test_export_bytes_do_not_depend_on_insertion_order(tmp_path: Any) -> None:
    rs = _data.results(22, 25)
    with open_storage("sqlite://") as a, open_storage("sqlite://") as b:
        a.put_results(rs)
        for r in reversed(rs):
            b.put_results([r])
        assert export_json(a) == export_json(b)
        assert export_json(a).endswith(b"}\n")


def test_export_order_survives_a_relabel() -> None:
    """A relabel (every entry of one direction moved to a new kernels hash on identical
    machine code) changes those entries' software lines and nothing else of the export: no
    entry changes its place, whichever side of the other direction's software fingerprint
    the new one sorts on."""
    rng = random.Random(24)
    rs: dict[tuple[Any, ...], _data.Result] = {}
    while len(rs) < 30:
        r = _data.result(rng, device=rng.choice((H200, A100)))
        r = dataclasses.replace(r, software=SW if r.key.direction == "bwd" else OLD_SW)
        rs.setdefault((r.device, r.key), r)
    before = list(rs.values())
    # New forward hashes whose fingerprints sort below and above the backward's.
    news = [dataclasses.replace(OLD_SW, kernels_hash=f"{i:064x}") for i in range(1, 40)]
    low = next(s for s in news if s.fingerprint < SW.fingerprint)
    high = next(s for s in news if s.fingerprint > SW.fingerprint)
    with open_storage("sqlite://") as s:
        s.put_results(before)
        old = json.loads(export_json(s))["entries"]
    for new in (low, high):
        after = [dataclasses.replace(r, software=new) if r.key.direction == "fwd" else r
                 for r in before]
        with open_storage("sqlite://") as s:
            s.put_results(after)
            got = json.loads(export_json(s))["entries"]
        assert [(e["device"], e["direction"], e["problem"]) for e in got] == \
            [(e["device"], e["direction"], e["problem"]) for e in old]
        assert [e["software"]["kernels_hash"] for e in got] == \
            [new.kernels_hash if e["direction"] == "fwd" else e["software"]["kernels_hash"]
             for e in old]


def test_export_filters_by_device(tmp_path: Any) -> None:
    rs = _data.results(23, 30)
    with open_storage("sqlite://") as s:
        s.put_results(rs)
        only = validate_export(export_json(s, device="H200"))
        assert {r.device for r in only} == {H200}
        assert len(only) == sum(r.device == H200 for r in rs)
        assert {r.device for r in validate_export(export_json(s, device=A100.fingerprint))} \
            == {A100}


@pytest.mark.parametrize("prefer, origin, winner", [
    ("faster", "imported", "file"), ("ours", "imported", "db"), ("theirs", "imported", "file"),
    # A result measured into this database stands against a faster claim, unless forced.
    ("faster", "local", "db"), ("ours", "local", "db"), ("theirs", "local", "file"),
])
def test_import_merges_by_prefer_and_keeps_provenance(prefer: str, origin: str,
                                                      winner: str) -> None:
    base = _data.results(24, 1, devices=(H200,), software=(SW,))[0]
    stored = dataclasses.replace(_data.retimed(base, 2 * base.median_ms, host="db-host"),
                                 origin=origin)
    incoming = _data.retimed(base, base.median_ms, host="file-host",
                             created_at="2025-01-02T03:04:05+00:00")
    with open_storage("sqlite://") as s:
        s.put_results([stored])
        report = import_json(s, dump(doc([incoming])), prefer=prefer)
        got = s.get_result(H200, SW, base.key)
    assert got is not None
    if winner == "db":
        assert got == stored and report.kept == 1 and got.origin == origin
    else:  # the file's entry, provenance and all, is faster here too
        assert got.origin == "imported"
        assert got.host == "file-host"
        assert got.created_at == "2025-01-02T03:04:05.000000+00:00"
        assert report.replaced == 1


def test_import_with_a_bad_entry_writes_nothing(tmp_path: Any) -> None:
    rs = _data.results(25, 5)
    d = doc(rs)
    d["entries"][3]["config"]["maxnreg"] = 3
    path = tmp_path / "t.db"
    with open_storage(str(path)) as s:
        s.put_results(rs[:1])
    before = path.read_bytes()
    with open_storage(str(path)) as s:
        with pytest.raises(ImportValidationError,
                           match=r"^entry 3: field config.maxnreg: 3 is not allowed; "
                                 r"allowed: 0, 128, 168, 200, 232, 255$"):
            import_json(s, dump(d))
        assert len(s.results()) == 1
    assert path.read_bytes() == before


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format_version=2), r"^field format_version: 2 is not supported"),
    (lambda d: d.update(format="other"), r"^field format: \"other\" is not allowed"),
    (lambda d: d.update(extra=1), r"^field extra: unknown field"),
    (lambda d: d["entries"][1].update(colour="red"), r"^entry 1: field colour: unknown field"),
    (lambda d: d["entries"][0].pop("median_ms"), r"^entry 0: field median_ms: missing"),
    (lambda d: d["entries"][0]["config"].update(block_m=48),
     r"^entry 0: field config.block_m: 48 is not allowed; allowed: 16, 32, 64, 128, 192, 256$"),
    (lambda d: d["entries"][0]["config"].update(tma=True),
     r"^entry 0: field config.tma: unknown field; allowed: "),
    (lambda d: d["entries"][0]["problem"].update(sq_bucket=1000),
     r"^entry 0: field problem.sq_bucket: 1000 is not a power of two"),
    (lambda d: d["entries"][0]["problem"].update(head_dim=100),
     r"^entry 0: field problem.head_dim: 100 is not allowed"),
    (lambda d: d["entries"][0].update(trials="many"),
     r"^entry 0: field trials: expected an integer, got \"many\"$"),
    (lambda d: d["entries"][0].update(tflops=10**400),
     r"^entry 0: field tflops: an integer of 1329 bits is out of range"),
    (lambda d: d["entries"][0].update(median_ms=-1.0), r"^entry 0: field median_ms: -1.0 is out"),
    (lambda d: d["entries"][0]["device"].update(name="a\u0000b"),
     r"^entry 0: field device.name: contains control characters"),
    (lambda d: d["entries"][0].update(created_at="yesterday"),
     r"^entry 0: field created_at: \"yesterday\" is not an ISO-8601 time$"),
    (lambda d: d["entries"].append(d["entries"][0]),
     r"^entry 2: duplicates entry 0 \(same device, software and problem\)$"),
    (lambda d: d["entries"][0]["example"].update(seqlen_q=5000),
     r"^entry 0: field example: its key .* differs from the entry's problem"),
    # A value of any size is named in a few words (a fuzzed import once printed a
    # thousand-deep object in full).
    (lambda d: d["entries"][0]["example"].update(dtype={"a": [{"a": 1}] * 500}),
     r"^entry 0: field example.dtype: an object is not allowed; allowed: fp16, bf16$"),
    (lambda d: d["entries"][0]["example"].update(dtype="fp8"),
     r"^entry 0: field example.dtype: \"fp8\" is not allowed; allowed: fp16, bf16$"),
    (lambda d: d["entries"][0]["example"].update(deterministic="yes"),
     r"^entry 0: field example.deterministic: expected true/false, got \"yes\"$"),
])
def test_validation_names_entry_and_field(mutate: Any, message: str) -> None:
    rng = random.Random(27)
    rs = []
    for direction in ("fwd", "bwd"):
        p = _data.problem(rng)
        rs.append(_data.result(rng, direction=direction, p=p, problem=p))
    d = doc(rs)
    validate_export(dump(d))  # the unmutated document is valid
    mutate(d)
    with pytest.raises(ImportValidationError, match=message) as e:
        validate_export(dump(d))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("data, message", [
    (b"\xff\xfe", "not UTF-8"),
    (b"", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),
    (b'{"entries": [], "format": "flashtune-tuning-db", "format_version": NaN}',
     "NaN is not a number JSON allows"),
    (b"[]", "expected an object"),
])
def test_garbage_documents_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(ImportValidationError, match=message):
        validate_export(data)


def test_shipped_layer_is_a_canonical_export() -> None:
    from importlib import resources

    data = resources.files("flashtune").joinpath("data").joinpath("shipped.json").read_bytes()
    entries = validate_export(data)
    with open_storage("sqlite://") as s:
        import_json(s, data)
        assert export_json(s) == data  # stored exactly as `autotune export` writes it
    assert shipped_results(SW) == [r.against(SW) for r in entries]
