"""The online-challenge beacon's tables, as witness 0.5 defined them (0006 brings them up to date).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create beacon_runs, beacon_heads and beacon_evidence."""
    op.create_table(
        "beacon_runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run", sa.String(64), nullable=False, unique=True),
        sa.Column("public_key", sa.String(64), nullable=False, index=True),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.Column("first_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_size", sa.Integer(), nullable=False),
        sa.Column("last_root", sa.String(64), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("equivocated", sa.Boolean(), nullable=False),
    )
    op.create_table(
        "beacon_heads",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("beacon_runs.id"), nullable=False, index=True),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("head_json", sa.Text(), nullable=False),
        sa.Column("statement_json", sa.Text(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("run_id", "size"),
    )
    op.create_table(
        "beacon_evidence",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("beacon_runs.id"), nullable=False, index=True),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("stamped_json", sa.Text(), nullable=False),
        sa.Column("other_json", sa.Text(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    """Drop them."""
    for table in ("beacon_evidence", "beacon_heads", "beacon_runs"):
        op.drop_table(table)
