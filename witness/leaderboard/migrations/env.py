"""Alembic environment: runs on the connection the server hands in (``witness.leaderboard.db.migrate``)."""

from alembic import context

from witness.leaderboard.db import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through witness.leaderboard.db.migrate(engine)")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
