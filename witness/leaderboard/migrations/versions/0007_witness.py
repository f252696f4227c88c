"""The beacon as a C2SP tlog-witness: the run logs registered with it, each with the latest checkpoint
it cosigned, and the first refused fork of each.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create witness_logs and witness_forks."""
    op.create_table(
        "witness_logs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("origin", sa.String(80), nullable=False, unique=True),
        sa.Column("origin_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("run", sa.String(64), nullable=False, unique=True),
        sa.Column("public_key", sa.String(64), nullable=False, index=True),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.Column("recipe", sa.String(64), nullable=False, index=True),
        sa.Column("seed", sa.String(64), nullable=True, index=True),
        sa.Column("first_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_ms", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("cosignature", sa.Text(), nullable=True),
        sa.Column("forked", sa.Boolean(), nullable=False),
    )
    op.create_table(
        "witness_forks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("log_id", sa.Integer(), sa.ForeignKey("witness_logs.id"), nullable=False, unique=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("latest_note", sa.Text(), nullable=False),
        sa.Column("other_note", sa.Text(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    """Drop them."""
    for table in ("witness_forks", "witness_logs"):
        op.drop_table(table)
