"""The initial schema: accounts, tracks, runs, heads, jobs, rounds, challenges.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create every table."""
    op.create_table(
        "accounts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("public_key", sa.String(64), nullable=False, unique=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "tracks",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("task", sa.String(64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("data_root", sa.String(64), nullable=False),
        sa.Column("eval_root", sa.String(64), nullable=False),
        sa.Column("eval_size", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(64), nullable=False),
        sa.Column("higher_is_better", sa.Boolean(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("track", sa.String(64), sa.ForeignKey("tracks.name"), nullable=False, index=True),
        sa.Column("r", sa.String(64), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("ticket_ms", sa.BigInteger(), nullable=False),
        sa.Column("submitted_ms", sa.BigInteger(), nullable=True),
        sa.Column("decided_ms", sa.BigInteger(), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("final_size", sa.Integer(), nullable=True),
        sa.Column("final_root", sa.String(64), nullable=True),
        sa.Column("final_state_hash", sa.String(64), nullable=True),
        sa.Column("metric_value", sa.Float(), nullable=True, index=True),
        sa.Column("aggregates_json", sa.Text(), nullable=True),
        sa.Column("contamination", sa.Text(), nullable=True),
        sa.Column("bound", sa.Float(), nullable=True),
        sa.Column("eval_bound", sa.Float(), nullable=True),
        sa.Column("challenges_passed", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("verdict_json", sa.Text(), nullable=True),
        sa.Column("bundle_sha256", sa.String(64), nullable=True),
        sa.Column("bundle_bytes", sa.BigInteger(), nullable=True),
    )
    op.create_table(
        "heads",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("root", sa.String(64), nullable=False),
        sa.Column("head_json", sa.Text(), nullable=False),
        sa.Column("received_ms", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("run_id", "size"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("requested_by", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=True, index=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("claimed_ms", sa.BigInteger(), nullable=True),
        sa.Column("finished_ms", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id"), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("requested_by", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=True),
        sa.Column("nonce", sa.String(64), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("bound", sa.Float(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("worker", sa.String(128), nullable=False),
        sa.Column("finished_ms", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "challenges",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id"), nullable=False, index=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("length", sa.Integer(), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("distances_json", sa.Text(), nullable=False),
        sa.Column("failure", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    """Drop every table."""
    for table in ("challenges", "rounds", "jobs", "heads", "runs", "tracks", "accounts"):
        op.drop_table(table)
