"""``python -m flashtune.cli``: the ``autotune`` command line."""

from flashtune.cli import main

main()
