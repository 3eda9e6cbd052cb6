"""The ``autotune`` command line (click group).

Each command family lives in its own module (tune, sweep, db, bench, report, info,
verify);
this file only wires their commands into the group. ``python -m flashtune.cli`` is the
same as ``autotune``.
"""

from __future__ import annotations

import click

from flashtune._version import __version__
from flashtune.cli import bench, db, info, report, sweep, tune, verify


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        # click turns a KeyboardInterrupt into "Aborted!" and status 1; a Ctrl-C that comes
        # before a command installs its own handling (while a sweep still imports, say)
        # exits 130, as it does after, and as shells report SIGINT.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashtune")
def main() -> None:
    """flashtune: autotuned Triton flash-attention kernels and their tuning database."""


for _cmd in (db.export, db.import_, db.show, tune.tune_cmd, sweep.sweep, bench.bench,
             report.report, info.info, verify.verify_cmd):
    main.add_command(_cmd)
