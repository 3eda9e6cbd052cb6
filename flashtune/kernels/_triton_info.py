"""What the installed Triton is, read from its package metadata: no ``import triton``.

The config module (and through it the database's import validation) needs only the
version number, so it must not pay for, or depend on, importing Triton itself.
"""

from __future__ import annotations

from importlib import metadata


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) when it is not installed."""
    try:
        text = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return (0, 0)
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]
