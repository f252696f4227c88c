"""Ranking methods, not seeds: the certified seeds a method needs to enter a track's ranking.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add tracks.min_seeds (3 for the tracks there are)."""
    op.add_column("tracks", sa.Column("min_seeds", sa.Integer(), nullable=False, server_default="3"))


def downgrade() -> None:
    """Drop it."""
    op.drop_column("tracks", "min_seeds")
