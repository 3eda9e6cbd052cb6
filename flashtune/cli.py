"""The ``autotune`` command line (click group).

Each command family lives in its own module and lists its commands in
``COMMANDS``; this file only wires them into the group, so the families can grow
independently.
"""

from __future__ import annotations

import click

from flashtune import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashtune")
def main() -> None:
    """flashtune: autotuned Triton flash-attention kernels and their tuning database."""


def _register() -> None:
    from flashtune import _cli_db, _cli_sweep, _cli_tune

    for mod in (_cli_db, _cli_tune, _cli_sweep):
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()


if __name__ == "__main__":
    main()
