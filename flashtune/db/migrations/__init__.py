"""Alembic migrations of the tuning database, run programmatically by
:mod:`flashtune.db.rdb` when a database is opened.

For a new revision, from the repository root::

    alembic -c flashtune/db/migrations/alembic.ini -x url=sqlite:///tmp.db revision \\
        --autogenerate -m "what changed"
"""
