"""The beacon's tables: runs it answered for, every head it stamped with its statement, and the
evidence of equivocation (two signed heads of one size with different roots)."""

from __future__ import annotations

import json

from sqlalchemy import (
    BigInteger,
    Boolean,
    Connection,
    Engine,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    inspect,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..commit.beacon import recipe_id
from .witness_db import WitnessBase


class BeaconBase(DeclarativeBase):
    """Declarative base of the beacon's tables (their own metadata: the leaderboard creates them too)."""


class BeaconRun(BeaconBase):
    """A run the beacon answered for, named by its manifest's leaf hash."""

    __tablename__ = "beacon_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run: Mapped[str] = mapped_column(String(64), unique=True)
    public_key: Mapped[str] = mapped_column(String(64), index=True)
    manifest: Mapped[str] = mapped_column(Text)
    first_ms: Mapped[int] = mapped_column(BigInteger)
    last_ms: Mapped[int] = mapped_column(BigInteger)
    last_size: Mapped[int] = mapped_column(Integer)
    last_root: Mapped[str] = mapped_column(String(64))
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    equivocated: Mapped[bool] = mapped_column(Boolean, default=False)
    # what links attempts: the recipe (``commit.beacon.recipe_id``), the run seed and, at a leaderboard,
    # the account (the key is ``public_key``)
    recipe: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    seed: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    account: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


class BeaconHead(BeaconBase):
    """A stamped head and the signed statement the beacon answered it with."""

    __tablename__ = "beacon_heads"
    # one statement per size, and one per window start: a window is drawn once
    __table_args__ = (UniqueConstraint("run_id", "size"),
                      Index("uq_beacon_heads_window", "run_id", "prev_size", unique=True))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("beacon_runs.id"), index=True)
    size: Mapped[int] = mapped_column(Integer)
    prev_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    root: Mapped[str] = mapped_column(String(64))
    head_json: Mapped[str] = mapped_column(Text)
    statement_json: Mapped[str] = mapped_column(Text)
    received_ms: Mapped[int] = mapped_column(BigInteger)


class BeaconEvidence(BeaconBase):
    """Two heads the run's key signed for one size with different roots: proof that it forked."""

    __tablename__ = "beacon_evidence"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("beacon_runs.id"), index=True)
    size: Mapped[int] = mapped_column(Integer)
    stamped_json: Mapped[str] = mapped_column(Text)
    other_json: Mapped[str] = mapped_column(Text)
    received_ms: Mapped[int] = mapped_column(BigInteger)


def create_tables(engine: Engine) -> None:
    """Create the beacon's tables where they are missing (a standalone beacon's database), and bring
    those of an earlier release up to date."""
    BeaconBase.metadata.create_all(engine)
    WitnessBase.metadata.create_all(engine)
    with engine.begin() as conn:
        add_linking(conn)


def add_linking(conn: Connection) -> None:
    """Add what witness 0.5's tables lack, filled in from what they hold: each run's recipe and run seed,
    an account column, and each stamped head's window start, unique per run (one draw per window)."""
    have = {c["name"] for c in inspect(conn).get_columns("beacon_runs")}
    if "recipe" not in have:
        for column, width in (("recipe", 64), ("seed", 64), ("account", 128)):
            conn.execute(text(f"ALTER TABLE beacon_runs ADD COLUMN {column} VARCHAR({width})"))
            conn.execute(text(f"CREATE INDEX ix_beacon_runs_{column} ON beacon_runs ({column})"))
        for rid, manifest in conn.execute(text("SELECT id, manifest FROM beacon_runs")).all():
            m = json.loads(manifest)
            conn.execute(text("UPDATE beacon_runs SET recipe = :r, seed = :s WHERE id = :i"),
                         {"r": recipe_id(m).hex(), "s": str(m.get("run_seed"))[:64], "i": rid})
    if "prev_size" not in {c["name"] for c in inspect(conn).get_columns("beacon_heads")}:
        conn.execute(text("ALTER TABLE beacon_heads ADD COLUMN prev_size INTEGER"))
        for hid, st in conn.execute(text("SELECT id, statement_json FROM beacon_heads")).all():
            conn.execute(text("UPDATE beacon_heads SET prev_size = :p WHERE id = :i"),
                         {"p": json.loads(st)["prev_size"], "i": hid})
        # a database that already holds two statements of one window (the race of witness 0.5) keeps
        # them as they are: new ones are held to one per window by the stamp's conditional update
        twice = conn.execute(text("SELECT 1 FROM beacon_heads GROUP BY run_id, prev_size HAVING COUNT(*) > 1")).first()
        if twice is None:
            conn.execute(text("CREATE UNIQUE INDEX uq_beacon_heads_window ON beacon_heads (run_id, prev_size)"))
