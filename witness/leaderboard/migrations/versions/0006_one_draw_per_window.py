"""One draw per window, restarts linked, online uploads taken once: the beacon's recipe and account
columns and each head's window start (unique per run), and the ledger entry of each selected step a
live round replayed (the certification counts it in its bound without replaying it again).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

from witness.beacon.db import add_linking

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add beacon_runs.recipe and .account, beacon_heads.prev_size, online_steps.ledger_json."""
    add_linking(op.get_bind())
    with op.batch_alter_table("online_steps") as t:
        t.add_column(sa.Column("ledger_json", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("online_steps") as t:
        t.drop_column("ledger_json")
    with op.batch_alter_table("beacon_heads") as t:
        t.drop_column("prev_size")
    with op.batch_alter_table("beacon_runs") as t:
        t.drop_column("account")
        t.drop_column("recipe")
