"""Alembic environment: migrates only flashtune's ``ft_*`` tables, with a version table
of its own, on the connection :mod:`flashtune.db.rdb` hands over (or on ``-x url=...``
when run from the alembic command line)."""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine

from flashtune.db.models import VERSION_TABLE, Base


def _ours(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    # Optuna's tables share the database: never autogenerate anything for them.
    return type_ != "table" or bool(name and name.startswith("ft_"))


def _run(connection: Any) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      version_table=VERSION_TABLE, include_object=_ours,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(context.get_x_argument(as_dictionary=True)["url"])
    with engine.begin() as conn:
        _run(conn)
