"""``cli._common.json_stdout``: stdout kept for one JSON document, in a real process."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import os, subprocess, sys
from flashtune.cli._common import json_stdout
print("before", flush=True)
with json_stdout({enabled}) as emit:
    print("printed inside", flush=True)
    os.write(1, b"written to descriptor 1\\n")
    subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    emit('{{"doc": 1}}')
print("after")
"""


def _run(enabled: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SCRIPT.format(enabled=enabled)],
                          capture_output=True, text=True, timeout=120, check=True)


def test_everything_else_goes_to_stderr_while_it_lasts() -> None:
    r = _run(True)
    assert r.stdout == 'before\n{"doc": 1}\nafter\n'
    assert r.stderr.splitlines() == ["printed inside", "written to descriptor 1",
                                     "from a child"]


def test_disabled_it_changes_nothing() -> None:
    r = _run(False)
    assert r.stdout.splitlines() == ["before", "printed inside", "written to descriptor 1",
                                     "from a child", '{"doc": 1}', "after"]
    assert r.stderr == ""
