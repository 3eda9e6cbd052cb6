"""Device and software fingerprints: stable, cheap, and free of sqlalchemy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import flashtune.kernels
from flashtune.db.fingerprint import (
    BWD_ONLY_MODULES,
    CPU_INTERPRETER,
    HOST_ONLY_MODULES,
    DeviceInfo,
    SoftwareInfo,
    device_info,
    kernels_hash,
    software_info,
)


def test_fingerprints_are_pinned() -> None:
    # Changing these orphans every database in the field: never do it by accident.
    h200 = DeviceInfo(name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
    assert h200.fingerprint == "7d10776c6eec68fb"
    sw = SoftwareInfo(torch="2.13.0", triton="3.9.0", cuda="12.8", kernels_hash="a" * 64,
                      ptxas="12.9.86")
    assert sw.fingerprint == "b53a63839f3dc290"
    # The 0003 migration computes the fingerprints of old rows (no ptxas) with this rule.
    old = SoftwareInfo(torch="2.12.0", triton="3.9.0", cuda="12.6", kernels_hash="a" * 64)
    assert old.fingerprint == "5490a658e4d11625"
    assert DeviceInfo("NVIDIA H200", "9.0", 132, 141).fingerprint != h200.fingerprint


BASE = SoftwareInfo(torch="2.13.0", triton="3.9.0", cuda="12.8", kernels_hash="a" * 64,
                    ptxas="12.9.86")


@pytest.mark.parametrize("field, value, stale", [
    ("kernels_hash", "b" * 64, True),  # other kernel sources: other generated code
    ("triton", "3.10.0", True),
    ("ptxas", "13.0.48", True),
    ("ptxas", "", False),  # not recorded (flashtune <= 0.1): judged by the other fields
    ("torch", "2.14.0", False),  # provenance only
    ("cuda", "13.0", False),  # provenance only
])
def test_staleness_rule_per_field(field: str, value: str, stale: bool) -> None:
    from dataclasses import replace

    from flashtune.db.fingerprint import stale_fields

    other = replace(BASE, **{field: value})
    assert stale_fields(other, BASE) == ([field] if stale else [])
    assert (other.fingerprint != BASE.fingerprint) is (field in ("kernels_hash", "triton",
                                                                  "ptxas"))


def test_ptxas_version_is_recorded() -> None:
    sw = software_info()
    # Triton's wheel bundles ptxas; where it cannot run, "none" (never empty: "" is
    # reserved for results stored before the version was recorded).
    assert sw.ptxas and (sw.ptxas == "none" or sw.ptxas[0].isdigit())


def test_interpreter_is_a_device_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d = device_info()
    assert d.name == CPU_INTERPRETER and (d.sm_count, d.memory_gb) == (0, 0)
    assert device_info("cuda:0") == d  # whatever is asked for, the interpreter runs it


def test_device_matches_fingerprint_or_name_part() -> None:
    d = DeviceInfo(name="NVIDIA H200", capability="9.0", sm_count=132, memory_gb=140)
    assert d.matches(d.fingerprint) and d.matches("h200") and not d.matches("a100")


def test_kernels_hash_follows_content_not_order(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("B = 1\n")
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "notes.txt").write_text("ignored")
    first = kernels_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("still ignored")
    assert kernels_hash(tmp_path) == first
    (tmp_path / "a.py").write_text("A = 2\n")
    assert kernels_hash(tmp_path) != first


def test_kernels_hash_leaves_out_the_host_only_modules(tmp_path: Path) -> None:
    (tmp_path / "attn_fwd.py").write_text("K = 1\n")
    (tmp_path / "_plans.py").write_text("P = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "_plans.py").write_text("S = 1\n")  # only top-level names are exempt
    first = kernels_hash(tmp_path)
    (tmp_path / "_plans.py").write_text("P = 2\n")
    assert kernels_hash(tmp_path) == first
    for name in ("attn_fwd.py", "sub/_plans.py", "new_module.py"):
        (tmp_path / name).write_text("changed = True\n")
        assert kernels_hash(tmp_path) != first, name
        first = kernels_hash(tmp_path)


def test_the_forward_hash_leaves_out_the_backwards_own_modules(tmp_path: Path) -> None:
    for name in ("attn_fwd.py", "attn_bwd.py", "attn_bwd_hopper.py", "_bwd_common.py",
                 "config.py", "_plans.py"):
        (tmp_path / name).write_text(f"# {name}\n")
    fwd, whole = kernels_hash(tmp_path, "fwd"), kernels_hash(tmp_path)
    assert fwd != whole and kernels_hash(tmp_path, "bwd") == whole
    for name in sorted(BWD_ONLY_MODULES):  # the backward's own: the forward's hash holds
        (tmp_path / name).write_text("changed = True\n")
        assert kernels_hash(tmp_path, "fwd") == fwd, name
        assert kernels_hash(tmp_path) != whole, name
        whole = kernels_hash(tmp_path)
    for name in ("attn_fwd.py", "config.py"):  # shared or the forward's: both move
        (tmp_path / name).write_text("changed = True\n")
        assert kernels_hash(tmp_path, "fwd") != fwd and kernels_hash(tmp_path) != whole, name
        fwd, whole = kernels_hash(tmp_path, "fwd"), kernels_hash(tmp_path)
    (tmp_path / "_plans.py").write_text("changed = True\n")  # host-only: neither
    assert (kernels_hash(tmp_path, "fwd"), kernels_hash(tmp_path)) == (fwd, whole)


def _imported_kernel_modules(tree: ast.AST) -> set[str]:
    """File names of the ``flashtune.kernels`` modules an AST imports (any form)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:
                mod = "flashtune.kernels." + mod if mod else "flashtune.kernels"
            if mod == "flashtune.kernels":
                out |= {f"{a.name}.py" for a in node.names}
            elif mod.startswith("flashtune.kernels."):
                out.add(mod.split(".")[2] + ".py")
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] + ".py" for a in node.names
                    if a.name.startswith("flashtune.kernels.")}
    return out


def test_no_forward_module_imports_the_backwards_own() -> None:
    """What lets a forward result ignore :data:`BWD_ONLY_MODULES`: no hashed module of the
    forward imports one, at any level (``reference.py``, the gate's, does inside its
    backward check, and is not hashed)."""
    root = Path(flashtune.kernels.__file__).parent
    assert BWD_ONLY_MODULES <= {p.name for p in root.glob("*.py")}
    for path in sorted(root.glob("*.py")):
        if path.name in HOST_ONLY_MODULES | BWD_ONLY_MODULES:
            continue
        tree = ast.parse(path.read_text())
        assert not _imported_kernel_modules(tree) & BWD_ONLY_MODULES, path.name


def test_no_kernel_module_imports_the_reference() -> None:
    """What leaves ``reference.py`` out of the hash: no hashed module imports it, so what a
    config compiles to and how it launches cannot depend on it."""
    root = Path(flashtune.kernels.__file__).parent
    assert "reference.py" in HOST_ONLY_MODULES
    hashed = [p for p in sorted(root.glob("*.py")) if p.name not in HOST_ONLY_MODULES]
    assert len(hashed) >= 5
    for path in hashed:
        assert "reference.py" not in _imported_kernel_modules(ast.parse(path.read_text())), \
            path.name


def test_a_forward_result_is_judged_by_the_forwards_sources() -> None:
    from dataclasses import replace

    from flashtune.db.fingerprint import stale_fields

    now = replace(BASE, fwd_kernels_hash="f" * 64)
    fwd_stored, bwd_stored = now.for_direction("fwd"), now.for_direction("bwd")
    assert (fwd_stored.kernels_hash, bwd_stored.kernels_hash) == ("f" * 64, "a" * 64)
    assert "fwd_kernels_hash" not in fwd_stored.as_dict()
    assert stale_fields(fwd_stored, now, "fwd") == stale_fields(bwd_stored, now, "bwd") == []
    # Stored before forward hashes (the whole hash): fresh while no source changed.
    assert stale_fields(bwd_stored, now, "fwd") == []
    # A backward-only change: the forward's results stay fresh, the backward's go stale.
    after = replace(now, kernels_hash="c" * 64)
    assert stale_fields(fwd_stored, after, "fwd") == []
    assert stale_fields(bwd_stored, after, "bwd") == ["kernels_hash"]
    assert stale_fields(bwd_stored, after, "fwd") == ["kernels_hash"]  # legacy: can't tell
    # A forward change: everything goes stale.
    after = replace(now, kernels_hash="c" * 64, fwd_kernels_hash="d" * 64)
    assert stale_fields(fwd_stored, after, "fwd") == ["kernels_hash"]
    # A backward result never counts as fresh under the forward's hash; without a
    # direction the rule is the whole hash's.
    assert stale_fields(fwd_stored, now, "bwd") == stale_fields(fwd_stored, now) \
        == ["kernels_hash"]


def _launch_deciding_names(tree: ast.AST) -> list[str]:
    """What a module that decides nothing of a kernel or its launch must not hold: a jit
    decorator, an import of a kernel language, grid arithmetic (``cdiv``), or the
    construction of a prepared launch (``*Launch(...)`` but the forward and backward
    launches of a plan, which the kernel modules build)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"@{ast.unparse(d)}" for d in node.decorator_list if "jit" in ast.unparse(d)]
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith(("triton.language", "triton.experimental"))):
            found.append(f"from {node.module}")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(
                ("triton.language", "triton.experimental"))]
        elif isinstance(node, ast.Attribute) and node.attr == "cdiv":
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id.endswith("Launch") and node.func.id not in ("FwdLaunch",
                                                                            "BwdLaunch"):
            found.append(f"{node.func.id}(...)")
    return found


def test_the_host_only_modules_define_no_kernel_and_build_no_launch() -> None:
    root = Path(flashtune.kernels.__file__).parent
    for name in sorted(HOST_ONLY_MODULES):
        tree = ast.parse((root / name).read_text())
        assert _launch_deciding_names(tree) == [], name
    # The check can fail: a kernel module holds each of these.
    found = _launch_deciding_names(ast.parse((root / "attn_fwd.py").read_text()))
    assert any(x.startswith("@") for x in found) and "triton.cdiv" in found
    assert any(x == "BoundLaunch(...)" for x in found)


def test_software_info_is_cached_and_hashes_the_kernels() -> None:
    sw = software_info()
    assert software_info() is sw
    assert sw.kernels_hash == kernels_hash() and len(sw.kernels_hash) == 64
    assert sw.torch and sw.triton and sw.cuda


def test_dispatch_path_imports_no_sqlalchemy() -> None:
    code = ("import sys, flashtune, flashtune.db, flashtune.db.exchange; "
            "from flashtune.db import device_info, software_info, shipped_results; "
            "device_info(); software_info(); shipped_results(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic')]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={"TRITON_INTERPRET": "1", "PATH": ""})
    assert p.returncode == 0, p.stderr
