"""The board's own history: every decision and revocation an entry of an append-only log.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create board_entries."""
    op.create_table(
        "board_entries",
        sa.Column("index", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("entry", sa.Text(), nullable=False),
        sa.Column("made_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    """Drop it."""
    op.drop_table("board_entries")
