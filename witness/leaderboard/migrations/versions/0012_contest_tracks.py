"""Contest tracks: a budget instead of a recipe, and the methods submitted to them.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add tracks.contest_json, the methods and method_admissions tables and runs.method_id."""
    op.add_column("tracks", sa.Column("contest_json", sa.Text(), nullable=True))
    op.create_table(
        "methods",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("track", sa.String(64), sa.ForeignKey("tracks.name"), nullable=False, index=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("wheel_sha256", sa.String(64), nullable=False),
        sa.Column("files_sha256", sa.String(64), nullable=False),
        sa.Column("distribution", sa.String(100), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("task", sa.String(64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("params", sa.BigInteger(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("account_id", "track", "files_sha256"),
    )
    op.create_table(
        "method_admissions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("made_ms", sa.BigInteger(), nullable=False),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("method_id", sa.Integer(), sa.ForeignKey("methods.id", name="fk_runs_method"),
                                   nullable=True))
        batch.create_index("ix_runs_method_id", ["method_id"])


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_method_id")
        batch.drop_column("method_id")
    op.drop_table("method_admissions")
    op.drop_table("methods")
    op.drop_column("tracks", "contest_json")
