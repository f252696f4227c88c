"""Flood limits: the address an account was registered from, and a per-account request counter
whose update serialises an account's re-challenge requests.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add accounts.address and accounts.challenge_requests."""
    with op.batch_alter_table("accounts") as t:
        t.add_column(sa.Column("address", sa.String(64), nullable=True))
        t.add_column(sa.Column("challenge_requests", sa.Integer(), nullable=False, server_default="0"))
        t.create_index("ix_accounts_address", ["address"])


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("accounts") as t:
        t.drop_index("ix_accounts_address")
        t.drop_column("challenge_requests")
        t.drop_column("address")
