"""The leaderboard's database: accounts, tracks, runs, streamed heads, the job queue, challenges.

SQLite (one file, the embedded default) or PostgreSQL (scale-out: many workers on many machines).
Times are integer milliseconds since the epoch, stamped by the server's clock. The schema is
created and changed only by the Alembic migrations in ``migrations/``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Boolean,
    Engine,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..database import check_db_url, make_engine, sessions  # noqa: F401 - re-exported for the leaderboard's modules

MIGRATIONS = Path(__file__).parent / "migrations"


def now_ms() -> int:
    """The server's clock, in milliseconds."""
    return int(time.time() * 1000)


class Base(DeclarativeBase):
    """Declarative base of the leaderboard's tables."""


class Account(Base):
    """A submitter: a registered Ed25519 key; only a hash of the API token is stored."""

    __tablename__ = "accounts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    # Where the registration came from (the client address), for the per-address limit.
    address: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    # Accepted re-challenge requests; incrementing it first locks the account for the rate check.
    challenge_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Track(Base):
    """A registered recipe: task name, exact config, dataset root and evaluation split."""

    __tablename__ = "tracks"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    task: Mapped[str] = mapped_column(String(64))
    config_json: Mapped[str] = mapped_column(Text)
    data_root: Mapped[str] = mapped_column(String(64))
    eval_root: Mapped[str] = mapped_column(String(64))
    eval_size: Mapped[int] = mapped_column(Integer)
    metric: Mapped[str] = mapped_column(String(64))
    higher_is_better: Mapped[bool] = mapped_column(Boolean)
    description: Mapped[str] = mapped_column(Text)
    # the least selection probability of online challenges a run must take (None: not required)
    online_p: Mapped[float | None] = mapped_column(Float, nullable=True)
    # a witnessed track's trust (canonical JSON: its witnesses' note keys and quorum, the operator log's
    # key, the drand chain and its endpoint); None: its online challenges come from the server's beacon
    witnessed_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the certified seeds a method needs to enter the ranking of methods (witness.leaderboard.ranking)
    min_seeds: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    # a contest track: its budget (``methods.contest.Budget``); its runs bring their own method
    contest_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class Run(Base):
    """One ticketed run, from its ticket to its verdict (and a revocation, if one comes)."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    track: Mapped[str] = mapped_column(ForeignKey("tracks.name"), index=True)
    r: Mapped[str] = mapped_column(String(64), unique=True)
    # ticketed -> pending -> verifying -> certified | rejected; certified -> revoked
    status: Mapped[str] = mapped_column(String(16), index=True)
    ticket_ms: Mapped[int] = mapped_column(BigInteger)
    submitted_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    decided_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    final_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    final_root: Mapped[str | None] = mapped_column(String(64), nullable=True)
    final_state_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metric_value: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    aggregates_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    contamination: Mapped[str | None] = mapped_column(Text, nullable=True)
    bound: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_bound: Mapped[float | None] = mapped_column(Float, nullable=True)
    challenges_passed: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    verdict_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    bundle_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    bundle_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # what the submitter says of the run (shown escaped; the code link only if it is http(s))
    title: Mapped[str | None] = mapped_column(String(100), nullable=True)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    code_url: Mapped[str | None] = mapped_column(String(300), nullable=True)
    statement: Mapped[str | None] = mapped_column(Text, nullable=True)  # the server's latest signed decision
    # the run's online-challenge probability (its manifest's), when it takes them from this server's beacon
    online_p: Mapped[float | None] = mapped_column(Float, nullable=True)
    method_id: Mapped[int | None] = mapped_column(ForeignKey("methods.id"), nullable=True, index=True)


class Method(Base):
    """A submitted method of a contest track: its wheel (in the store, by its SHA-256), the pin a run's
    manifest must carry, and what the sandbox described of it when it was admitted."""

    __tablename__ = "methods"
    __table_args__ = (UniqueConstraint("account_id", "track", "files_sha256"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    track: Mapped[str] = mapped_column(ForeignKey("tracks.name"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    wheel_sha256: Mapped[str] = mapped_column(String(64))
    files_sha256: Mapped[str] = mapped_column(String(64))
    distribution: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(64))
    task: Mapped[str] = mapped_column(String(64))
    config_json: Mapped[str] = mapped_column(Text)
    steps: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    params: Mapped[int] = mapped_column(BigInteger)
    created_ms: Mapped[int] = mapped_column(BigInteger)


class Admission(Base):
    """One request to admit a method, admitted or not (each runs the method in the sandbox: the hourly limit
    counts these)."""

    __tablename__ = "method_admissions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    made_ms: Mapped[int] = mapped_column(BigInteger)


class Head(Base):
    """A signed tree head streamed while training, with the server's own receipt time."""

    __tablename__ = "heads"
    __table_args__ = (UniqueConstraint("run_id", "size"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    size: Mapped[int] = mapped_column(Integer)
    root: Mapped[str] = mapped_column(String(64), index=True)  # (a run's id is its first head's root)
    head_json: Mapped[str] = mapped_column(Text)
    received_ms: Mapped[int] = mapped_column(BigInteger)


class LogLine(Base):
    """A record of an online run's log, streamed with the head that covers it (what the server's
    workers replay the selected steps against while the run trains)."""

    __tablename__ = "log_lines"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    line: Mapped[str] = mapped_column(Text)


def run_manifest(s, run_id: int) -> dict:  # noqa: ANN001 - a Session
    """A streamed run's manifest, the first line of its log ({} before its first head came)."""
    first = s.get(LogLine, (run_id, 0))
    return json.loads(first.line) if first is not None else {}


class OnlineStep(Base):
    """A step the server's beacon selected for a run: its uploads, then its replay's outcome."""

    __tablename__ = "online_steps"
    __table_args__ = (UniqueConstraint("run_id", "step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    # selected -> ready (its state and samples arrived) -> passed | failed
    status: Mapped[str] = mapped_column(String(16), index=True)
    selected_ms: Mapped[int] = mapped_column(BigInteger)
    state_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    has_samples: Mapped[bool] = mapped_column(Boolean, default=False)
    round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"), nullable=True)
    failure: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the ledger entry of the replay that passed it (``verify.ledger.LedgerEntry``, JSON): the
    # certification counts the step in its bound from this evidence, without replaying it again
    ledger_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class OnlineWindow(Base):
    """The chunk openings a chunked online run uploaded for one window (by the head size it closes at),
    and whether a live round checked every step of it."""

    __tablename__ = "online_windows"
    __table_args__ = (UniqueConstraint("run_id", "size"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)  # the steps of the window
    sha256: Mapped[str] = mapped_column(String(64))
    received_ms: Mapped[int] = mapped_column(BigInteger)
    # uploaded -> checked (every step's opened moves within the bound) | failed
    status: Mapped[str] = mapped_column(String(16), index=True)
    round_id: Mapped[int | None] = mapped_column(ForeignKey("rounds.id"), nullable=True)


class WitnessedWindowRow(Base):
    """A witnessed window a run sent while it trained (checked on arrival: the run's checkpoint entered in
    the server's operator log, the operator checkpoint cosigned, the drand round signed), as the line the
    bundle's statements hold, with who cosigned it in time and its round, for the run page."""

    __tablename__ = "witnessed_windows"
    __table_args__ = (UniqueConstraint("run_id", "size"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    round: Mapped[int] = mapped_column(BigInteger)
    line: Mapped[str] = mapped_column(Text)
    cosigners_json: Mapped[str] = mapped_column(Text)  # the track's witnesses that cosigned it in time (names)
    on_time: Mapped[bool] = mapped_column(Boolean)  # K of them cosigned more than a drand period before the round
    received_ms: Mapped[int] = mapped_column(BigInteger)


class BoardEntry(Base):
    """One entry of the board's own history (a decision, a revocation), in order: an append-only log whose
    checkpoints the server signs (``witness.leaderboard.board``)."""

    __tablename__ = "board_entries"
    index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    entry: Mapped[str] = mapped_column(Text)  # canonical JSON
    made_ms: Mapped[int] = mapped_column(BigInteger)


class Job(Base):
    """A unit of verification work in the queue: certify a submission, or re-challenge a run."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # certify | rechallenge | online
    count: Mapped[int] = mapped_column(Integer)
    requested_by: Mapped[int | None] = mapped_column(ForeignKey("accounts.id"), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued | running | done | failed
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_ms: Mapped[int] = mapped_column(BigInteger)
    claimed_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Round(Base):
    """One round of challenges on a run: the public challenge history."""

    __tablename__ = "rounds"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    requested_by: Mapped[int | None] = mapped_column(ForeignKey("accounts.id"), nullable=True)
    nonce: Mapped[str] = mapped_column(String(64))
    count: Mapped[int] = mapped_column(Integer)
    passed: Mapped[bool] = mapped_column(Boolean)
    bound: Mapped[float] = mapped_column(Float)
    detail: Mapped[str] = mapped_column(Text)
    worker: Mapped[str] = mapped_column(String(128))
    finished_ms: Mapped[int] = mapped_column(BigInteger)
    statement: Mapped[str | None] = mapped_column(Text, nullable=True)  # the server's signed decision (DSSE)


class ChallengeRow(Base):
    """One replay challenge of a round, with its distances."""

    __tablename__ = "challenges"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    length: Mapped[int] = mapped_column(Integer)
    passed: Mapped[bool] = mapped_column(Boolean)
    distances_json: Mapped[str] = mapped_column(Text)
    failure: Mapped[str | None] = mapped_column(Text, nullable=True)


def migrate(engine: Engine) -> None:
    """Bring the schema up to date with Alembic (``upgrade head``)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
