"""Every step checked: the chunk openings a chunked online run uploads for each window, and whether a
live round checked them.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create online_windows."""
    op.create_table(
        "online_windows",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id"), nullable=True),
        sa.UniqueConstraint("run_id", "size"),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("online_windows")
