"""The tuning database: fingerprints, storage, export/import, the shipped layer.

``from flashtune.db import open_storage`` works, but nothing heavy loads until used:
fingerprints and the export format never import sqlalchemy; :func:`open_storage`
loads it on first call.
"""

from __future__ import annotations

from typing import Any

from flashtune.db.fingerprint import DeviceInfo, SoftwareInfo, device_info, software_info
from flashtune.db.storage import Result, Storage, open_storage

__all__ = ["DeviceInfo", "SoftwareInfo", "device_info", "software_info", "Result", "Storage",
           "open_storage", "export_json", "import_json", "validate_export", "shipped_results",
           "ImportReport"]

_EXCHANGE = ("export_json", "import_json", "validate_export", "shipped_results",
             "ImportReport")


def __getattr__(name: str) -> Any:
    if name in _EXCHANGE:
        from flashtune.db import exchange

        return getattr(exchange, name)
    raise AttributeError(f"module 'flashtune.db' has no attribute {name!r}")
