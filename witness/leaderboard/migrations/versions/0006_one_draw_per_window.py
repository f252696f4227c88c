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
    """Add beacon_runs.recipe, .seed and .account, beacon_heads.prev_size, online_steps.ledger_json; the
    account of every run the leaderboard streamed (its first head's root names it at the beacon), so
    that a run in progress during the upgrade goes on, linked to its account."""
    conn = op.get_bind()
    add_linking(conn)
    firsts = conn.execute(sa.text("SELECT heads.root, runs.account_id FROM heads JOIN runs ON heads.run_id = runs.id "
                                  "WHERE heads.size = 1")).all()
    for root, account in firsts:
        conn.execute(sa.text("UPDATE beacon_runs SET account = :a WHERE run = :r AND account IS NULL"),
                     {"a": f"account:{account}", "r": root})
    with op.batch_alter_table("online_steps") as t:
        t.add_column(sa.Column("ledger_json", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("online_steps") as t:
        t.drop_column("ledger_json")
    with op.batch_alter_table("beacon_heads") as t:
        t.drop_column("prev_size")
    with op.batch_alter_table("beacon_runs") as t:
        for column in ("account", "seed", "recipe"):
            t.drop_column(column)
