"""The tuning database: fingerprints, storage, export/import, the shipped layer.

``from flashtune.db import open_storage`` works, but nothing heavy loads until used:
fingerprints and the export format never import sqlalchemy; :func:`open_storage`
loads it on first call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashtune._env import cache_home, database_url
from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, device_info, software_info
from flashtune.db.storage import Result, Storage, provenance

__all__ = ["DeviceInfo", "SoftwareInfo", "device_info", "software_info", "Result", "Storage",
           "open_storage", "resolve_url", "default_path", "provenance", "export_json",
           "import_json", "validate_export", "shipped_results", "ImportReport"]

_EXCHANGE = ("export_json", "import_json", "validate_export", "shipped_results",
             "ImportReport")


def __getattr__(name: str) -> Any:
    if name in _EXCHANGE:
        from flashtune.db import exchange

        return getattr(exchange, name)
    raise AttributeError(f"module 'flashtune.db' has no attribute {name!r}")


def default_path() -> Path:
    """Where the tuning database lives when neither ``--db`` nor ``FLASHTUNE_DB`` says.

    The user data directory (``platformdirs.user_data_dir``: ``$XDG_DATA_HOME/flashtune``
    or ``~/.local/share/flashtune`` on Linux, ``~/Library/Application Support/flashtune``
    on macOS, ``%LOCALAPPDATA%\\flashtune`` on Windows): tuning results are expensive data,
    not a cache a cleaner may delete. A database at the location of flashtune <= 0.1
    (``$XDG_CACHE_HOME/flashtune/tuning.db``, else ``~/.cache/...``) is kept in use while
    there is none at the new one, so no one loses results by upgrading.
    """
    import platformdirs

    new = Path(platformdirs.user_data_dir("flashtune", appauthor=False)) / "tuning.db"
    legacy = Path(cache_home()) / "flashtune" / "tuning.db"
    return legacy if legacy.is_file() and not new.exists() else new


def resolve_url(url: str | os.PathLike[str] | None = None) -> str:
    """The SQLAlchemy URL for ``url``: None means ``FLASHTUNE_DB`` or :func:`default_path`;
    a plain path means SQLite at that path; ``postgresql://`` uses psycopg (v3)."""
    if url is None:
        url = database_url() or default_path()
    text = os.fspath(url)
    if not text.strip():
        from flashtune.exceptions import StorageError

        raise StorageError("the database path or URL is empty")
    if "://" not in text:
        return "sqlite:///" + str(Path(text).expanduser().absolute())
    for plain in ("postgresql://", "postgres://"):
        if text.startswith(plain):
            return "postgresql+psycopg://" + text[len(plain):]
    return text


def open_storage(url: str | os.PathLike[str] | None = None, *,
                 read_only: bool = False, busy_timeout: float | None = None,
                 create: bool = True) -> Storage:
    """Open (creating or upgrading if needed, unless ``read_only``) the tuning database.

    See :func:`resolve_url` for ``url``. SQLite runs in WAL mode with a 30 s busy
    timeout (``busy_timeout`` seconds instead, e.g. short for the dispatcher, which must
    never stall a training step); a SQLite file that does not exist raises a
    :class:`~flashtune.exceptions.DatabaseMissingError` if opened ``read_only`` or with
    ``create=False``.
    """
    from flashtune.db.rdb import RDBStorage

    return RDBStorage(resolve_url(url), read_only=read_only, busy_timeout=busy_timeout,
                      create=create)
