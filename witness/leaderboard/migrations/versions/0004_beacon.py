"""The online-challenge beacon's tables (the same definitions a standalone beacon creates).

Revision ID: 0004
Revises: 0003
"""

from alembic import op

from witness.beacon.db import BeaconBase

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create beacon_runs, beacon_heads and beacon_evidence."""
    BeaconBase.metadata.create_all(op.get_bind())


def downgrade() -> None:
    """Drop them."""
    BeaconBase.metadata.drop_all(op.get_bind())
