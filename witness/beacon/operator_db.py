"""An operator log's tables: its entries in order, and each checkpoint it had cosigned."""

from __future__ import annotations

from sqlalchemy import BigInteger, Engine, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class OperatorBase(DeclarativeBase):
    """Declarative base of the operator log's tables."""


class OperatorEntry(OperatorBase):
    """One entry of the log: its index (the leaf's position), its bytes, and what it says."""

    __tablename__ = "operator_entries"
    index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    entry: Mapped[bytes] = mapped_column(LargeBinary)
    kind: Mapped[str] = mapped_column(String(4))  # "run" or "head"
    run: Mapped[str] = mapped_column(String(64), index=True)  # the run's id (hex)
    seed: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)  # a run entry's seed tag
    size: Mapped[int] = mapped_column(BigInteger)  # a head entry's size of the run's log (0 for a run entry)
    received_ms: Mapped[int] = mapped_column(BigInteger)


class OperatorCheckpoint(OperatorBase):
    """A checkpoint of the log the witnesses cosigned: the note with the log's signature and theirs."""

    __tablename__ = "operator_checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger, unique=True)
    root: Mapped[str] = mapped_column(String(64))
    note: Mapped[str] = mapped_column(Text)
    made_ms: Mapped[int] = mapped_column(BigInteger)


def create_tables(engine: Engine) -> None:
    """Create the operator log's tables where they are missing."""
    OperatorBase.metadata.create_all(engine)
