"""`autotune info`: the device, versions, the database and its layers (no GPU needed)."""

from __future__ import annotations

import json
from typing import Any

import click

from flashtune.cli._common import (
    clean_errors,
    db_file,
    db_option,
    interpreting,
    where,
)


def _layer(name: str, source: str, results: list[Any]) -> dict[str, Any]:
    by_dev: dict[str, int] = {}
    for r in results:
        by_dev[r.device.name] = by_dev.get(r.device.name, 0) + 1
    return {"name": name, "source": source, "entries": len(results),
            "stale": sum(r.stale for r in results), "entries_by_device": by_dev}


def info_dict(db_url: str | None) -> dict[str, Any]:
    """What ``autotune info`` reports, as a dict (no GPU needed)."""
    import platform
    from importlib import metadata

    import torch

    from flashtune._version import __version__
    from flashtune.db import open_storage, resolve_url
    from flashtune.db.exchange import shipped_results
    from flashtune.db.fingerprint import device_info, software_info
    from flashtune.exceptions import DatabaseMissingError

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    dev, sw = device_info(), software_info()
    url = resolve_url(db_url)
    exists, results, misses = True, [], 0
    try:
        with open_storage(url, read_only=True) as st:
            results = st.results(software=sw)
            misses = sum(c for _, c, _ in st.misses())
    except DatabaseMissingError:
        exists = False
    user = _layer("user", where(url), results)
    shipped = _layer("shipped", "flashtune/data/shipped.json", shipped_results(sw))
    return {
        "flashtune": __version__,
        "device": {**dev.as_dict(), "fingerprint": dev.fingerprint},
        "cuda_available": torch.cuda.is_available(),
        "interpreter": interpreting(),
        "software": {**sw.as_dict(), "fingerprint": sw.fingerprint},
        "versions": {"python": platform.python_version(), "flashtune": __version__,
                     "torch": sw.torch, "triton": sw.triton, "cuda": sw.cuda,
                     "optuna": version("optuna"), "sqlalchemy": version("sqlalchemy")},
        "database": {"url": where(url), "path": db_file(url), "exists": exists},
        "entries": user["entries"], "stale": user["stale"], "misses": misses,
        "layers": [user, shipped],
    }


@click.command("info")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def info(db_url: str | None, as_json: bool) -> None:
    """Show the device fingerprint, versions, the database and its entry counts."""
    with clean_errors():
        d = info_dict(db_url)
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True))
        return
    dev, sw, db = d["device"], d["software"], d["database"]
    gpu = "" if d["cuda_available"] else "  (no CUDA GPU: kernels need --interpret)"
    click.echo(f"device     {dev['name']} (sm {dev['capability']}, {dev['sm_count']} SMs, "
               f"{dev['memory_gb']} GiB)  fingerprint {dev['fingerprint']}{gpu}")
    fwd = f", forward {sw['fwd_kernels_hash'][:12]}" if sw.get("fwd_kernels_hash") else ""
    click.echo(f"software   fingerprint {sw['fingerprint']} "
               f"(kernels {sw['kernels_hash'][:12]}{fwd})")
    click.echo("versions   " + "  ".join(f"{k} {v}" for k, v in d["versions"].items()))
    state = "" if db["exists"] else "  (not created yet)"
    click.echo(f"database   {db['path'] or db['url']}{state}")
    click.echo(f"entries    {d['entries']} ({d['stale']} stale), {d['misses']} recorded misses")
    for layer in d["layers"]:
        per = ", ".join(f"{k}: {v}" for k, v in sorted(layer["entries_by_device"].items()))
        click.echo(f"layer      {layer['name']:<8} {layer['entries']:>5} entries "
                   f"({layer['stale']} stale)  {layer['source']}" + (f"  [{per}]" if per else ""))
