"""What a run page shows: the submitter's name, description and code link for a run, and the
server's signed statement of each decision (an in-toto Statement in a DSSE envelope).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add runs.title, runs.description, runs.code_url, runs.statement and rounds.statement."""
    with op.batch_alter_table("runs") as t:
        t.add_column(sa.Column("statement", sa.Text(), nullable=True))
        t.add_column(sa.Column("title", sa.String(100), nullable=True))
        t.add_column(sa.Column("description", sa.Text(), nullable=True))
        t.add_column(sa.Column("code_url", sa.String(300), nullable=True))
    with op.batch_alter_table("rounds") as t:
        t.add_column(sa.Column("statement", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("rounds") as t:
        t.drop_column("statement")
    with op.batch_alter_table("runs") as t:
        t.drop_column("code_url")
        t.drop_column("description")
        t.drop_column("title")
        t.drop_column("statement")
