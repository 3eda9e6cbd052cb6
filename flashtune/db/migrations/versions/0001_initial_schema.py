"""initial schema: devices, software, problems, results, misses

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_KEY = ("direction", "dtype", "head_dim", "causal", "window", "softcap", "gqa_ratio",
        "bh_bucket", "sq_bucket", "sk_bucket")


def _id(table: str) -> list[Any]:
    return [sa.Column("id", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("id", name=f"pk_{table}")]


def _fk(table: str, column: str, target: str) -> list[Any]:
    return [sa.Column(column, sa.Integer(), nullable=False),
            sa.ForeignKeyConstraint([column], [f"{target}.id"],
                                    name=f"fk_{table}_{column}_{target}")]


def _str(name: str, length: int) -> sa.Column:
    return sa.Column(name, sa.String(length=length), nullable=False)


def upgrade() -> None:
    op.create_table(
        "ft_devices", *_id("ft_devices"), _str("fingerprint", 32), _str("name", 200),
        _str("capability", 32), sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("memory_gb", sa.Integer(), nullable=False),
        sa.UniqueConstraint("fingerprint", name="uq_ft_devices_fingerprint"))
    op.create_table(
        "ft_software", *_id("ft_software"), _str("fingerprint", 32), _str("torch", 128),
        _str("triton", 128), _str("cuda", 128), _str("kernels_hash", 128),
        sa.UniqueConstraint("fingerprint", name="uq_ft_software_fingerprint"))
    op.create_table(
        "ft_problems", *_id("ft_problems"), _str("direction", 8), _str("dtype", 16),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        *(sa.Column(c, sa.Boolean(), nullable=False) for c in ("causal", "window", "softcap")),
        *(sa.Column(c, sa.Integer(), nullable=False)
          for c in ("gqa_ratio", "bh_bucket", "sq_bucket", "sk_bucket")),
        sa.UniqueConstraint(*_KEY, name="uq_ft_problems_key"))
    op.create_table(
        "ft_results", *_id("ft_results"), *_fk("ft_results", "device_id", "ft_devices"),
        *_fk("ft_results", "software_id", "ft_software"),
        *_fk("ft_results", "problem_id", "ft_problems"),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("example_json", sa.Text(), nullable=True),
        *(sa.Column(c, sa.Double(), nullable=False)
          for c in ("median_ms", "p20_ms", "p80_ms", "tflops", "max_error")),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("search_seconds", sa.Double(), nullable=False),
        _str("host", 256), sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        _str("flashtune_version", 64),
        sa.UniqueConstraint("device_id", "software_id", "problem_id",
                            name="uq_ft_results_device_id_software_id_problem_id"))
    op.create_table(
        "ft_misses", *_id("ft_misses"), *_fk("ft_misses", "device_id", "ft_devices"),
        *_fk("ft_misses", "problem_id", "ft_problems"),
        *_fk("ft_misses", "software_id", "ft_software"),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("example_json", sa.Text(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("device_id", "problem_id", name="uq_ft_misses_device_id_problem_id"))


def downgrade() -> None:
    for table in ("ft_misses", "ft_results", "ft_problems", "ft_software", "ft_devices"):
        op.drop_table(table)
