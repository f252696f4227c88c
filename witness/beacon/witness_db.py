"""The witness's tables: the run logs registered with it, each with the latest checkpoint it cosigned,
and the first refused fork of each (tlog-witness asks a witness to keep only the latest checkpoint)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Engine, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class WitnessBase(DeclarativeBase):
    """Declarative base of the witness's tables (their own metadata: the leaderboard creates them too)."""


class WitnessLog(WitnessBase):
    """A run's log, registered by its manifest, and the latest checkpoint this witness cosigned for it."""

    __tablename__ = "witness_logs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    origin: Mapped[str] = mapped_column(String(80), unique=True)  # commit.note.run_origin
    origin_hash: Mapped[str] = mapped_column(String(64), unique=True)  # what the monitoring path names
    run: Mapped[str] = mapped_column(String(64), unique=True)  # the manifest's leaf hash (hex)
    public_key: Mapped[str] = mapped_column(String(64), index=True)  # the log's key: the manifest's
    manifest: Mapped[str] = mapped_column(Text)
    # what links attempts, as the beacon's runs have them (``commit.beacon.recipe_id``, the run seed)
    recipe: Mapped[str] = mapped_column(String(64), index=True)
    seed: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    first_ms: Mapped[int] = mapped_column(BigInteger)  # registered
    last_ms: Mapped[int] = mapped_column(BigInteger)  # the latest checkpoint cosigned (or registered)
    # the latest cosigned checkpoint: its size and root ("" until one is), the note as the monitoring
    # path serves it (the log's signature and the cosignature), and the cosignature line alone
    size: Mapped[int] = mapped_column(BigInteger)
    root: Mapped[str] = mapped_column(String(64))
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    cosignature: Mapped[str | None] = mapped_column(Text, nullable=True)
    forked: Mapped[bool] = mapped_column(Boolean, default=False)


class WitnessFork(WitnessBase):
    """The first validly signed checkpoint refused as a fork of a log: of the latest one's size with
    another root (``root``: proof the log forked), or not shown consistent with it (``proof``)."""

    __tablename__ = "witness_forks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    log_id: Mapped[int] = mapped_column(ForeignKey("witness_logs.id"), unique=True)  # one per log
    kind: Mapped[str] = mapped_column(String(8))
    size: Mapped[int] = mapped_column(BigInteger)
    latest_note: Mapped[str] = mapped_column(Text)  # the cosigned checkpoint it contradicts
    other_note: Mapped[str] = mapped_column(Text)  # the refused one, with the log's signature
    received_ms: Mapped[int] = mapped_column(BigInteger)


def create_tables(engine: Engine) -> None:
    """Create the witness's tables where they are missing."""
    WitnessBase.metadata.create_all(engine)
