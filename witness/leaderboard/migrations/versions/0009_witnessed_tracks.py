"""Witnessed tracks: the track's trust, the windows its runs send while they train, and the operator log
the server runs for them (the same tables as ``witness operator serve``'s).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add tracks.witnessed_json and an index on heads.root; create witnessed_windows, operator_entries and
    operator_checkpoints."""
    with op.batch_alter_table("tracks") as t:
        t.add_column(sa.Column("witnessed_json", sa.Text(), nullable=True))
    op.create_index("ix_heads_root", "heads", ["root"])  # a run found by its id (its first head's root)
    op.create_table(
        "witnessed_windows",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("round", sa.BigInteger(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.Column("cosigners_json", sa.Text(), nullable=False),
        sa.Column("on_time", sa.Boolean(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("run_id", "size"),
    )
    op.create_table(
        "operator_entries",
        sa.Column("index", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("entry", sa.LargeBinary(), nullable=False),
        sa.Column("kind", sa.String(4), nullable=False),
        sa.Column("run", sa.String(64), nullable=False, index=True),
        sa.Column("seed", sa.String(64), nullable=True, index=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "operator_checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False, unique=True),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("made_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    """Drop them."""
    op.drop_index("ix_heads_root", "heads")
    for table in ("operator_checkpoints", "operator_entries", "witnessed_windows"):
        op.drop_table(table)
    with op.batch_alter_table("tracks") as t:
        t.drop_column("witnessed_json")
