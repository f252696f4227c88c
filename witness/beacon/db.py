"""The beacon's tables: runs it answered for, every head it stamped with its statement, and the
evidence of equivocation (two signed heads of one size with different roots)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Engine,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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


class BeaconHead(BeaconBase):
    """A stamped head and the signed statement the beacon answered it with."""

    __tablename__ = "beacon_heads"
    __table_args__ = (UniqueConstraint("run_id", "size"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("beacon_runs.id"), index=True)
    size: Mapped[int] = mapped_column(Integer)
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
    """Create the beacon's tables where they are missing (a standalone beacon's database)."""
    BeaconBase.metadata.create_all(engine)
