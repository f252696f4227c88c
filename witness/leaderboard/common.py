"""What the leaderboard service and its streaming half share: its settings, its API error, and the
locks and checks both take."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from ..store import DEFAULT_MAX_UPLOAD
from ..verify.challenges import challenges_needed
from .db import (
    Run,
)
from .tracks import DEFAULT_TRACKS, TrackSpec, Witnessing

MAX_CONSISTENCY_HASHES = 64
MAX_ID = 2**31 - 1  # ids are INTEGER columns: a larger number names no row (and would overflow a driver)



class ApiError(Exception):
    """A refused request: HTTP status and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Settings:
    """Server configuration (command-line flags of ``witness leaderboard serve``)."""

    db_url: str
    store: Path | str  # a folder, or s3://bucket/prefix (then ``work`` is this process's local folder)
    max_upload: int = DEFAULT_MAX_UPLOAD
    confidence: float = 0.99
    bad_fraction: float = 0.05
    eval_spots: int = 100
    rechallenge_max: int = 500
    rechallenges_per_hour: int = 20
    # Flood limits: new accounts per client address per hour (each account brings its own
    # re-challenge allowance), and challenges queued or running on one run at any time.
    registrations_per_hour: int = 5
    max_queued_challenges: int = 1000
    clock_skew_ms: int = 5 * 60 * 1000
    # Time anchoring: the recorder streams a head at every checkpoint and at the end; a run
    # must not leave more than this many records between two streamed heads.
    max_head_gap: int = 200
    tracks: tuple[TrackSpec, ...] = field(default_factory=lambda: DEFAULT_TRACKS)
    # The key the server signs its decisions with (created on first start; default: in the store).
    server_key: Path | None = None
    # The address people reach the server at, for links that must work elsewhere (badges in a
    # README); default: the address each request came in on.
    public_url: str | None = None
    # Slow clients: a connection's request headers must be in within header_timeout seconds, and
    # an upload may not stall for more than body_idle_timeout seconds between two pieces.
    header_timeout: float = 10.0
    body_idle_timeout: float = 30.0
    # At start, uploads and stored files that no committed row names are removed once this old
    # (seconds): a crash left them; an upload in flight on another server is younger.
    orphan_after_s: float = 3600.0
    # The local working folder of a server or worker whose store is s3:// (uploads being received,
    # unpacked bundles); a local store is its own.
    work: Path | None = None
    # With an s3:// store: downloads redirect to presigned URLs on this endpoint (the store as the
    # readers reach it; "" for the endpoint the server uses), instead of streaming through the server.
    presign_endpoint: str | None = None
    # With an s3:// store: at most this many bytes of unpacked bundles kept in ``work`` (the least
    # recently used go first, never one in use); None keeps every one.
    cache_bytes: int | None = None
    # The operator log this server runs for its witnessed tracks (None: it runs none, and a track that
    # names witnesses is refused at start). One process appends to it: the server, never its workers.
    witnessing: Witnessing | None = None

    @property
    def certify_challenges(self) -> int:
        """q for a new submission: detection >= confidence when a fraction f of steps is bad."""
        return challenges_needed(self.confidence, self.bad_fraction)


def _describe(run: Run, fields: set[str], title: str | None, description: str | None, code_url: str | None) -> None:
    """Set the given fields of a run's description, refusing a code link that is not http(s)."""
    if "code_url" in fields and code_url and not re.match(r"^https?://[^\s<>\"']+$", code_url):
        raise ApiError(400, "the code link must be an http(s) URL")
    values = {"title": title, "description": description, "code_url": code_url}
    for name in fields & set(values):
        setattr(run, name, (values[name] or "").strip() or None)


def _valid_id(value: object) -> bool:
    return type(value) is int and 1 <= value <= MAX_ID


def _lock_writes(s: Session) -> None:
    """Begin the session's transaction with a write, so that what it counts next cannot change
    under it: SQLite's database-wide write lock (pysqlite starts its transaction at the first
    write), and on PostgreSQL the accounts table's lock against concurrent registrations."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("LOCK TABLE accounts IN SHARE ROW EXCLUSIVE MODE"))
    else:
        s.execute(text("UPDATE accounts SET id = id WHERE 0"))


def _lock_run(s: Session, run_id: int) -> None:
    """Hold the run's row for this transaction (SQLite: the database's write lock), so that a head
    is checked against the last one and stored as one step: of heads streamed in parallel, each is
    checked against what the one before it stored."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(select(Run.id).where(Run.id == run_id).with_for_update())
    else:
        s.execute(update(Run).where(Run.id == run_id).values(id=Run.id).execution_options(synchronize_session=False))


def _hide(e: Exception, staging: Path) -> str:
    """An error's message with the server's own paths replaced: the store's layout is not the
    client's business (names inside the upload are kept, relative to it)."""
    msg = str(e)
    for root in (str(staging.resolve()), str(staging)):
        msg = msg.replace(root + "/", "").replace(root, "the upload")
    return msg


def token_hash(token: str) -> str:
    """What the database keeps of an API token."""
    return hashlib.sha256(token.encode()).hexdigest()
