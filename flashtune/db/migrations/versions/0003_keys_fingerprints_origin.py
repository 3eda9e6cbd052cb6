"""keys, fingerprints and origins: deterministic and packed keys, code-only software
fingerprints, torch/CUDA as result provenance, each result's origin and verify outcome

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

- ``ft_problems`` gains ``deterministic`` (old rows: true), ``packed`` (false) and
  ``tokens_bucket`` (0), all three in the unique key. Results and misses whose example is
  a packed batch (stored under the dense key until now) move to their packed key.
- ``ft_software`` keeps only what changes the generated code: ``triton``, ``kernels_hash``
  and the new ``ptxas`` (old rows: ``""``, not recorded); its fingerprint is recomputed
  from those. Rows that differed only by torch or CUDA become one; where two of their
  results hold one (device, problem), the faster is kept (what an import with
  ``prefer="faster"`` keeps). Old results are thereby re-judged: staleness is computed on
  read from the code fields alone.
- ``ft_results`` gains ``torch`` and ``cuda`` (from its software row), ``origin`` (old
  rows: ``"unknown"``: flashtune <= 0.1 did not record whether a result was imported),
  ``verify`` (``"unverified"``) and ``verified_at`` (null).
- ``ft_misses`` rows follow their merged software row.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from alembic import op

# On SQLite, batch mode alters a table by copying it, dropping the old one and renaming the
# copy: flashtune.db.rdb runs migrations with foreign-key checks off, and checks every
# reference before it commits.

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_OLD_KEY = ("direction", "dtype", "head_dim", "causal", "window", "softcap", "gqa_ratio",
            "bh_bucket", "sq_bucket", "sk_bucket")
_KEY = (*_OLD_KEY, "deterministic", "packed", "tokens_bucket")


def _digest(*parts: object) -> str:
    # The fingerprint rule of flashtune.db.fingerprint, frozen here: a migration must not
    # change when the package does.
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


def _problems() -> None:
    with op.batch_alter_table("ft_problems") as b:
        b.add_column(sa.Column("deterministic", sa.Boolean(), nullable=False,
                               server_default=sa.true()))
        b.add_column(sa.Column("packed", sa.Boolean(), nullable=False,
                               server_default=sa.false()))
        b.add_column(sa.Column("tokens_bucket", sa.Integer(), nullable=False,
                               server_default="0"))
        b.drop_constraint("uq_ft_problems_key", type_="unique")
        b.create_unique_constraint("uq_ft_problems_key", list(_KEY))
    with op.batch_alter_table("ft_problems") as b:  # defaults were for the old rows only
        for c in ("deterministic", "packed", "tokens_bucket"):
            b.alter_column(c, server_default=None)


def _results_columns() -> None:
    with op.batch_alter_table("ft_results") as b:
        for c in ("torch", "cuda"):
            b.add_column(sa.Column(c, sa.String(length=128), nullable=False,
                                   server_default=""))
        b.add_column(sa.Column("origin", sa.String(length=16), nullable=False,
                               server_default="unknown"))
        b.add_column(sa.Column("verify", sa.String(length=16), nullable=False,
                               server_default="unverified"))
        b.add_column(sa.Column("verified_at", sa.String(length=64), nullable=True))
    conn = op.get_bind()
    for c in ("torch", "cuda"):
        conn.execute(sa.text(f"UPDATE ft_results SET {c} = (SELECT s.{c} FROM ft_software s "
                             "WHERE s.id = ft_results.software_id)"))
    with op.batch_alter_table("ft_results") as b:
        for c in ("torch", "cuda", "origin", "verify"):
            b.alter_column(c, server_default=None)


def _bucket(n: int) -> int:
    # flashtune.problem.bucket, frozen here.
    return 1 if n <= 1 else min(1 << (int(n) - 1).bit_length(), 1 << 20)


def _packed_tokens(example_json: str | None) -> int:
    """The query tokens of a stored example problem; 0 for a dense one (or none)."""
    try:
        total = json.loads(example_json or "null") or {}
        return int(total.get("total_q", 0)) if isinstance(total, dict) else 0
    except (ValueError, TypeError):
        return 0  # a corrupt cell: its row is skipped when read, whatever its key


def _problem_id(conn: Any, old_id: int, tokens: int) -> int:
    """The id of problem ``old_id``'s packed twin with ``tokens`` tokens (made if new)."""
    cols = ", ".join(f'"{c}"' for c in _OLD_KEY)  # "window" is a keyword of PostgreSQL
    row = conn.execute(sa.text(f"SELECT {cols} FROM ft_problems WHERE id = :i"),
                       {"i": old_id}).one()
    key = dict(zip(_OLD_KEY, row, strict=True), deterministic=True, packed=True,
               tokens_bucket=_bucket(tokens))
    where = " AND ".join(f'"{c}" = :{c}' for c in _KEY)
    found = conn.execute(sa.text(f"SELECT id FROM ft_problems WHERE {where}"), key).scalar()
    if found is None:
        names = ", ".join(f'"{c}"' for c in _KEY)
        conn.execute(sa.text(f"INSERT INTO ft_problems ({names}) VALUES "
                             f"({', '.join(':' + c for c in _KEY)})"), key)
        found = conn.execute(sa.text(f"SELECT id FROM ft_problems WHERE {where}"), key).scalar()
    return int(found)


def _rekey_packed() -> None:
    """Results and misses of packed batches were stored under the dense key: move them to
    the packed key their example problem has. A result that then meets another on the same
    (device, software, key) keeps the faster, as for merged software rows."""
    conn = op.get_bind()
    for rid, dev, sw, prob, example, ms in conn.execute(sa.text(
            "SELECT id, device_id, software_id, problem_id, example_json, median_ms "
            "FROM ft_results ORDER BY id")).all():
        tokens = _packed_tokens(example)
        if tokens <= 0:
            continue
        new = _problem_id(conn, prob, tokens)
        other = conn.execute(sa.text(
            "SELECT id, median_ms FROM ft_results WHERE device_id = :d AND software_id = :s "
            "AND problem_id = :p"), {"d": dev, "s": sw, "p": new}).one_or_none()
        if other is not None and other[1] <= ms:
            conn.execute(sa.text("DELETE FROM ft_results WHERE id = :i"), {"i": rid})
            continue
        if other is not None:
            conn.execute(sa.text("DELETE FROM ft_results WHERE id = :i"), {"i": other[0]})
        conn.execute(sa.text("UPDATE ft_results SET problem_id = :p WHERE id = :i"),
                     {"p": new, "i": rid})
    for mid, dev, prob, example, count in conn.execute(sa.text(
            "SELECT id, device_id, problem_id, example_json, count FROM ft_misses "
            "ORDER BY id")).all():
        tokens = _packed_tokens(example)
        if tokens <= 0:
            continue
        new = _problem_id(conn, prob, tokens)
        other = conn.execute(sa.text("SELECT id FROM ft_misses WHERE device_id = :d AND "
                                     "problem_id = :p"), {"d": dev, "p": new}).scalar()
        if other is not None:  # counts add up under the packed key
            conn.execute(sa.text("UPDATE ft_misses SET count = count + :c WHERE id = :o"),
                         {"c": count, "o": other})
            conn.execute(sa.text("DELETE FROM ft_misses WHERE id = :i"), {"i": mid})
        else:
            conn.execute(sa.text("UPDATE ft_misses SET problem_id = :p WHERE id = :i"),
                         {"p": new, "i": mid})


def _merge_software() -> None:
    """New fingerprints from the code fields; rows that now coincide become one."""
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, triton, kernels_hash FROM ft_software ORDER BY id")
                        ).all()
    keep: dict[str, int] = {}
    for sid, triton, kernels in rows:
        fp = _digest(triton, "", kernels)
        if fp not in keep:
            keep[fp] = sid
            continue
        into = keep[fp]
        # Results of the merged row that collide with one of the kept row: the faster stays.
        clashes = conn.execute(sa.text(
            "SELECT a.id, a.median_ms, b.id, b.median_ms FROM ft_results a JOIN ft_results b "
            "ON a.device_id = b.device_id AND a.problem_id = b.problem_id "
            "WHERE a.software_id = :old AND b.software_id = :new"),
            {"old": sid, "new": into}).all()
        for a_id, a_ms, b_id, b_ms in clashes:
            if a_ms < b_ms:
                conn.execute(sa.text("DELETE FROM ft_results WHERE id = :i"), {"i": b_id})
            else:
                conn.execute(sa.text("DELETE FROM ft_results WHERE id = :i"), {"i": a_id})
        conn.execute(sa.text("UPDATE ft_results SET software_id = :new WHERE software_id = :old"),
                     {"old": sid, "new": into})
        # A miss row is unique per (device, problem): it only points at the software it was
        # last seen under.
        conn.execute(sa.text("UPDATE ft_misses SET software_id = :new WHERE software_id = :old"),
                     {"old": sid, "new": into})
        conn.execute(sa.text("DELETE FROM ft_software WHERE id = :old"), {"old": sid})
    # Fingerprints are unique: move every kept row to a temporary value first.
    for sid in keep.values():
        conn.execute(sa.text("UPDATE ft_software SET fingerprint = :t WHERE id = :i"),
                     {"t": f"~{sid}", "i": sid})
    for fp, sid in keep.items():
        conn.execute(sa.text("UPDATE ft_software SET fingerprint = :f WHERE id = :i"),
                     {"f": fp, "i": sid})


def upgrade() -> None:
    _problems()
    _results_columns()
    with op.batch_alter_table("ft_software") as b:
        b.add_column(sa.Column("ptxas", sa.String(length=128), nullable=False,
                               server_default=""))
    with op.batch_alter_table("ft_software") as b:
        b.alter_column("ptxas", server_default=None)
        b.drop_column("torch")
        b.drop_column("cuda")
    _rekey_packed()
    _merge_software()


def downgrade() -> None:
    # Back to 0002's tables; rows that only the new key tells apart (non-deterministic or
    # packed problems) are dropped with their results and misses, as are ptxas versions.
    conn = op.get_bind()
    extra = "SELECT id FROM ft_problems WHERE deterministic = :f OR packed = :t"
    args = {"f": False, "t": True}
    conn.execute(sa.text(f"DELETE FROM ft_results WHERE problem_id IN ({extra})"), args)
    conn.execute(sa.text(f"DELETE FROM ft_misses WHERE problem_id IN ({extra})"), args)
    conn.execute(sa.text("DELETE FROM ft_problems WHERE deterministic = :f OR packed = :t"), args)
    with op.batch_alter_table("ft_problems") as b:
        b.drop_constraint("uq_ft_problems_key", type_="unique")
        b.create_unique_constraint("uq_ft_problems_key", list(_OLD_KEY))
        for c in ("deterministic", "packed", "tokens_bucket"):
            b.drop_column(c)
    with op.batch_alter_table("ft_software") as b:
        for c in ("torch", "cuda"):
            b.add_column(sa.Column(c, sa.String(length=128), nullable=False,
                                   server_default="unknown"))
    with op.batch_alter_table("ft_software") as b:
        b.drop_column("ptxas")
        for c in ("torch", "cuda"):
            b.alter_column(c, server_default=None)
    with op.batch_alter_table("ft_results") as b:
        for c in ("torch", "cuda", "origin", "verify", "verified_at"):
            b.drop_column(c)
