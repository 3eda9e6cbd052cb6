"""sweep tables: ft_sweeps and ft_sweep_claims, until now made by the sweep's create_all

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

A database that a sweep already used has both tables, made by the ``create_all`` of
flashtune 0.1.0 with the same columns, unique constraint and index: they are kept as
they are (with their rows), and only the revision moves on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _exists(name: str) -> bool:
    return bool(sa.inspect(op.get_bind()).has_table(name))


def upgrade() -> None:
    if not _exists("ft_sweeps"):
        op.create_table(
            "ft_sweeps",
            sa.Column("id", sa.String(length=32), nullable=False),
            sa.Column("device_json", sa.Text(), nullable=False),
            sa.Column("software_fingerprint", sa.String(length=32), nullable=False),
            sa.Column("trials", sa.Integer(), nullable=True),
            sa.Column("total", sa.Integer(), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("id", name="pk_ft_sweeps"))
    if not _exists("ft_sweep_claims"):
        op.create_table(
            "ft_sweep_claims",
            sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("sweep_id", sa.String(length=32), nullable=False),
            sa.Column("task", sa.String(length=32), nullable=False),
            sa.Column("seq", sa.Integer(), nullable=False),
            sa.Column("direction", sa.String(length=3), nullable=False),
            sa.Column("key_json", sa.Text(), nullable=False),
            sa.Column("problem_json", sa.Text(), nullable=False),
            sa.Column("state", sa.String(length=8), nullable=False),
            sa.Column("worker", sa.String(length=200), nullable=True),
            sa.Column("host", sa.String(length=200), nullable=True),
            sa.Column("pid", sa.Integer(), nullable=True),
            sa.Column("lease_expires", sa.Float(), nullable=True),
            sa.Column("attempts", sa.Integer(), nullable=False),
            sa.Column("trials", sa.Integer(), nullable=True),
            sa.Column("best_tflops", sa.Float(), nullable=True),
            sa.Column("median_ms", sa.Float(), nullable=True),
            sa.Column("note", sa.Text(), nullable=True),
            sa.Column("started_at", sa.Float(), nullable=True),
            sa.Column("finished_at", sa.Float(), nullable=True),
            sa.PrimaryKeyConstraint("id", name="pk_ft_sweep_claims"),
            sa.UniqueConstraint("sweep_id", "task", name="uq_ft_sweep_claims_task"))
        op.create_index("ix_ft_sweep_claims_state", "ft_sweep_claims",
                        ["sweep_id", "state", "seq"])


def downgrade() -> None:
    op.drop_index("ix_ft_sweep_claims_state", table_name="ft_sweep_claims")
    op.drop_table("ft_sweep_claims")
    op.drop_table("ft_sweeps")
