"""Online tracks: a track's least online-challenge probability, a run's own, the streamed log of an
online run and the steps the beacon selected for it (replayed by the workers while it trains).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add tracks.online_p, runs.online_p, log_lines and online_steps."""
    with op.batch_alter_table("tracks") as t:
        t.add_column(sa.Column("online_p", sa.Float(), nullable=True))
    with op.batch_alter_table("runs") as t:
        t.add_column(sa.Column("online_p", sa.Float(), nullable=True))
    op.create_table(
        "log_lines",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("position", sa.Integer(), primary_key=True),
        sa.Column("line", sa.Text(), nullable=False),
    )
    op.create_table(
        "online_steps",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("selected_ms", sa.BigInteger(), nullable=False),
        sa.Column("state_sha256", sa.String(64), nullable=True),
        sa.Column("has_samples", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id"), nullable=True),
        sa.Column("failure", sa.Text(), nullable=True),
        sa.UniqueConstraint("run_id", "step"),
    )


def downgrade() -> None:
    """Drop them again."""
    op.drop_table("online_steps")
    op.drop_table("log_lines")
    with op.batch_alter_table("runs") as t:
        t.drop_column("online_p")
    with op.batch_alter_table("tracks") as t:
        t.drop_column("online_p")
