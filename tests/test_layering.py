"""The package's layering (DESIGN.md, "Layout"), checked from the source:

- no import cycle among flashtune modules (every import counts, also one inside a
  function; only ``if TYPE_CHECKING:`` blocks are left out);
- no module inside the package imports the package face, ``flashtune/__init__.py``;
- no ``flashtune.db`` module imports triton, and importing them all leaves it unloaded;
- ``import flashtune`` imports neither triton, optuna nor sqlalchemy, and the names of
  its public API resolve.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashtune"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every runtime import statement."""
    found: list[tuple[str, list[str]]] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [a.name for a in node.names]))
        stack.extend(ast.iter_child_nodes(node))
    return found


def _edges(name: str) -> set[str]:
    """The flashtune modules that module ``name`` imports."""
    out: set[str] = set()
    for module, names in _imports(ast.parse(MODULES[name].read_text())):
        if module.split(".")[0] != "flashtune":
            continue
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        if not names or len(subs) < len(names):
            out.add(module)  # `import m`, or names defined in m itself
        out.update(subs)
    out.discard(name)
    return out


GRAPH = {name: _edges(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_detection_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_flashtune_modules() -> None:
    assert _cycles(GRAPH) == []


def test_nothing_inside_the_package_imports_its_face() -> None:
    bad = sorted(n for n, deps in GRAPH.items() if "flashtune" in deps and n != "flashtune")
    assert bad == [], f"these modules import flashtune/__init__: {bad}"


def test_no_db_module_imports_triton() -> None:
    bad = sorted(name for name in MODULES if name.startswith("flashtune.db")
                 for module, _ in _imports(ast.parse(MODULES[name].read_text()))
                 if module.split(".")[0] == "triton")
    assert bad == [], f"these flashtune.db modules import triton: {bad}"


def _run(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_importing_the_db_package_loads_no_triton() -> None:
    mods = [n for n in MODULES if n.startswith("flashtune.db") and ".migrations" not in n]
    _run("import sys\n"
         + "".join(f"import {m}\n" for m in mods)
         + "assert 'triton' not in sys.modules, 'triton was imported'\n")


@pytest.mark.parametrize("heavy", ["triton", "optuna", "sqlalchemy"])
def test_import_flashtune_is_light(heavy: str) -> None:
    _run("import sys\nimport flashtune\n"
         f"assert {heavy!r} not in sys.modules, '{heavy} was imported'\n")


def test_public_names() -> None:
    _run("import flashtune\n"
         "from flashtune import FwdConfig, BwdConfig, Problem, __version__\n"
         "from flashtune.kernels.config import FwdConfig as F, BwdConfig as B\n"
         "from flashtune.problem import Problem as P\n"
         "assert (FwdConfig, BwdConfig, Problem) == (F, B, P)\n"
         "assert set(flashtune.__all__) >= {'flash_attention', 'explain', 'FwdConfig',\n"
         "                                  'BwdConfig', 'Problem', '__version__'}\n"
         "assert callable(flashtune.flash_attention) and callable(flashtune.explain)\n")
