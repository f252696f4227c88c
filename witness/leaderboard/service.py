"""What the leaderboard does, apart from HTTP: accounts, tickets, streamed heads, submissions,
re-challenge requests. Every failure is an ``ApiError`` with an HTTP status and a clear message."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from ..beacon.service import FINAL_EXTENSION, Beacon, BeaconRefused
from ..bundle.layout import MAX_RECORD_BYTES, STATEMENTS
from ..bundle.reader import open_bundle
from ..bundle.schema import parse_online
from ..commit.beacon import BeaconStatement, selected_steps
from ..commit.dsse import read_json_or_envelope
from ..commit.hashing import canonical_json, from_hex, leaf_hash, parse_canonical_json, same
from ..commit.log import RunLog
from ..commit.merkle import verify_consistency
from ..commit.signing import (
    SignedTreeHead,
    load_or_create_key,
    parse_public_key,
    public_hex,
    public_key_from_hex,
)
from ..errors import VerificationError
from ..store import DEFAULT_MAX_UPLOAD, EVALUATION, Upload, online_key, open_store
from ..verify.challenges import challenges_needed
from . import queue
from .db import (
    Account,
    Head,
    Job,
    LogLine,
    OnlineStep,
    Run,
    Track,
    make_engine,
    migrate,
    now_ms,
    sessions,
)
from .tracks import DEFAULT_TRACKS, TrackSpec

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_CERTIFICATE_BYTES = 256 * 1024 * 1024
MAX_CONSISTENCY_HASHES = 64


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

    @property
    def certify_challenges(self) -> int:
        """q for a new submission: detection >= confidence when a fraction f of steps is bad."""
        return challenges_needed(self.confidence, self.bad_fraction)


MAX_ID = 2**31 - 1  # ids are INTEGER columns: a larger number names no row (and would overflow a driver)


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


class Leaderboard:
    """The server's state: database, store, settings."""

    def __init__(self, settings: Settings, *, sync_tracks: bool = True):
        self.settings = settings
        self.engine = make_engine(settings.db_url)
        migrate(self.engine)
        self.Session = sessions(self.engine)
        self.store = open_store(settings.store, settings.work, settings.presign_endpoint, settings.cache_bytes)
        self.key = load_or_create_key(settings.server_key or self.store.root / "server_key.pem")
        self.public_key = public_hex(self.key.public_key())
        self.beacon = Beacon(self.key)  # the same beacon as `witness beacon serve`, signing with the server key
        self.randomness = os.urandom  # the server's own randomness: tickets and challenge nonces
        if sync_tracks:
            self.sync_tracks()

    def sync_tracks(self) -> None:
        """Register the configured tracks (a changed recipe replaces its row)."""
        with self.Session() as s:
            for spec in self.settings.tracks:
                row = s.get(Track, spec.name)
                resolved = spec.resolve()
                if row is None:
                    s.add(Track(**resolved))
                else:
                    for k, v in resolved.items():
                        setattr(row, k, v)
            s.commit()

    # --- accounts -----------------------------------------------------------------------
    def register(self, s: Session, name: str, public_key: str, address: str | None = None) -> tuple[Account, str]:
        """A new account for an Ed25519 key; returns it with its API token (shown once).

        At most ``registrations_per_hour`` accounts a client address may open in an hour: every
        account brings its own re-challenge allowance, so free accounts would multiply it."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ApiError(400, "an account name is 1-64 letters, digits, '.', '_' or '-'")
        try:
            public_key = parse_public_key(public_key)  # raw hex or PEM; stored as raw hex
        except VerificationError as e:
            raise ApiError(400, str(e)) from None
        address = (address or "unknown")[:64]
        _lock_writes(s)
        since = now_ms() - 3600 * 1000
        recent = s.scalar(select(func.count()).select_from(Account).where(
            Account.address == address, Account.created_ms > since))
        if recent >= self.settings.registrations_per_hour:
            raise ApiError(429, f"registration limit: {self.settings.registrations_per_hour} new accounts per hour "
                                "from one address; try again later")
        if s.scalar(select(Account).where(Account.name == name)) is not None:
            raise ApiError(409, f"the account name {name!r} is taken")
        if s.scalar(select(Account).where(Account.public_key == public_key)) is not None:
            raise ApiError(409, "this public key is already registered")
        token = secrets.token_urlsafe(32)
        acct = Account(name=name, public_key=public_key, token_hash=token_hash(token), created_ms=now_ms(),
                       address=address, challenge_requests=0)
        s.add(acct)
        s.commit()
        return acct, token

    def authenticate(self, s: Session, token: str | None) -> Account:
        """The account an API token belongs to."""
        if not token:
            raise ApiError(401, "this request needs an API token (Authorization: Bearer …)")
        acct = s.scalar(select(Account).where(Account.token_hash == token_hash(token)))
        if acct is None:
            raise ApiError(401, "unknown API token")
        return acct

    # --- tickets and streamed heads -----------------------------------------------------
    def track(self, s: Session, name: str) -> Track:
        """A registered track, or 404."""
        t = s.get(Track, name)
        if t is None:
            raise ApiError(404, f"no track {name!r}")
        return t

    def ticket(self, s: Session, acct: Account, track_name: str, title: str | None = None,
               description: str | None = None, code_url: str | None = None) -> Run:
        """Issue a run ticket: the server's r, so the run seed H(data root ‖ r) is fixed from now on."""
        self.track(s, track_name)
        run = Run(account_id=acct.id, track=track_name, r=self.randomness(32).hex(), status="ticketed",
                  ticket_ms=now_ms(), challenges_passed=0)
        _describe(run, {"title", "description", "code_url"}, title, description, code_url)
        s.add(run)
        s.commit()
        return run

    def describe(self, s: Session, acct: Account, run_id: int, fields: set[str], title: str | None,
                 description: str | None, code_url: str | None) -> Run:
        """Set what the owner says of a run (name, description, code link); nothing it claims is checked."""
        run = self.run(s, run_id)
        if run.account_id != acct.id:
            raise ApiError(403, f"run {run_id} belongs to another account")
        _describe(run, fields, title, description, code_url)
        s.commit()
        return run

    def run(self, s: Session, run_id: int) -> Run:
        """A run, or 404."""
        run = s.get(Run, run_id) if _valid_id(run_id) else None
        if run is None:
            raise ApiError(404, f"no run {run_id}")
        return run

    def add_head(self, s: Session, acct: Account, run_id: int, tree_head: object, consistency: list,
                 manifest: str | None, records: list | None = None) -> Head:
        """Stamp a streamed tree head, after checking its signature and that it extends the last one.

        A run with online challenges sends the log's records the head newly covers (``records``):
        the server's workers replay its selected steps against them while it trains."""
        run = self.run(s, run_id)
        if run.account_id != acct.id:
            raise ApiError(403, f"run {run_id} belongs to another account")
        _lock_run(s, run.id)
        s.refresh(run)  # as it is now that this request holds it
        if run.status != "ticketed":
            if run.status == "rejected":
                raise ApiError(409, f"run {run_id} was rejected: {run.reason}")
            raise ApiError(409, f"run {run_id} was submitted already; its log is closed")
        try:
            head = SignedTreeHead.from_json(tree_head)
            head.verify(public_key_from_hex(acct.public_key))
        except VerificationError as e:
            raise ApiError(400, f"tree head refused: {e}") from None
        t = now_ms()
        if head.timestamp_ms < run.ticket_ms - self.settings.clock_skew_ms or head.timestamp_ms > t + self.settings.clock_skew_ms:
            raise ApiError(400, "the tree head's timestamp lies before the ticket was issued or in the future")
        prev = s.scalar(select(Head).where(Head.run_id == run.id).order_by(Head.size.desc()).limit(1))
        if prev is None:
            m = self._check_first_head(s, run, acct, head, manifest)
            if records:
                raise ApiError(400, "the first streamed head covers the manifest alone: it comes with no records")
            if m.get("online") is not None:
                run.online_p = m["online"]["p"]
                s.add(LogLine(run_id=run.id, position=0, line=manifest))
        else:
            if not isinstance(consistency, list) or len(consistency) > MAX_CONSISTENCY_HASHES:
                raise ApiError(400, "consistency must be a list of at most 64 hex hashes")
            try:
                proof = [from_hex(h, "consistency hash") for h in consistency]
                verify_consistency(prev.size, head.size, bytes.fromhex(prev.root), head.root, proof)
            except (ValueError, VerificationError) as e:
                raise ApiError(400, f"the tree head does not extend the last streamed head "
                                    f"(size {prev.size}): {e}") from None
            if head.size == prev.size:
                return prev  # the same head again: nothing new to stamp
            if run.online_p is not None:
                self._add_records(s, run, prev.size, head, records)
            elif records:
                raise ApiError(400, "only a run with online challenges streams its records")
        row = Head(run_id=run.id, size=head.size, root=head.root.hex(),
                   head_json=canonical_json(head.to_json()).decode(), received_ms=t)
        s.add(row)
        s.commit()
        return row

    def _add_records(self, s: Session, run: Run, prev_size: int, head: SignedTreeHead, records: list | None) -> None:
        """Keep the records a head of an online run newly covers, after checking that they are the
        ones it signs (the log the server holds then hashes to the head's root)."""
        want = head.size - prev_size
        if not isinstance(records, list) or len(records) != want:
            raise ApiError(400, f"a run with online challenges streams the records each head newly covers: this head "
                                f"covers {want} more, and {len(records or [])} came with it")
        new = []
        for i, r in enumerate(records):
            if not isinstance(r, str) or "\n" in r or len(r) > MAX_RECORD_BYTES:
                raise ApiError(400, f"record {prev_size + i} is not one log line of at most {MAX_RECORD_BYTES} bytes")
            new.append(r.encode())
        lines = [x.encode() for x in s.scalars(select(LogLine.line).where(LogLine.run_id == run.id)
                                               .order_by(LogLine.position))]
        if len(lines) != prev_size:
            raise ApiError(409, f"the server holds {len(lines)} records of run {run.id}, not the last head's {prev_size}")
        if not same(RunLog(lines + new).root(head.size), head.root):
            raise ApiError(400, "the records sent are not the ones the tree head signs")
        s.add_all(LogLine(run_id=run.id, position=prev_size + i, line=r) for i, r in enumerate(records))

    def stamp(self, s: Session, head: Head, consistency: list, manifest: str | None) -> dict:
        """The beacon's signed statement for a head the server stamped (its randomness selects the
        steps of the head's window for online challenges, which the run then uploads)."""
        first = s.scalar(select(Head).where(Head.run_id == head.run_id, Head.size == 1))
        if first is None:
            raise ApiError(409, "the run's first streamed head is missing")
        run = s.get(Run, head.run_id)
        tree_head = json.loads(head.head_json)
        attempts = self.other_attempts(s, run) if FINAL_EXTENSION in (tree_head.get("extensions") or {}) else 0
        try:  # the account's runs are linked at the beacon, whatever keys and recipes they use
            st = self.beacon.stamp(s, tree_head, consistency, manifest, first.root,
                                   account=f"account:{run.account_id}", attempts=attempts)
        except BeaconRefused as e:
            raise ApiError(e.status, e.message) from None
        if run.online_p is not None:
            self._select(s, run, st)
        return st.to_json()

    def other_attempts(self, s: Session, run: Run) -> int:
        """The account's other runs that streamed a head (their trainer saw draws) and were not
        certified: abandoned, rejected, revoked or not yet decided. Each may have been an attempt at
        this run that a draw caught, so the run's final statement prices them into its bound (a run
        killed and resumed with ``--resume`` stays one run)."""
        streamed = select(Head.run_id).where(Head.run_id == Run.id).exists()
        return int(s.scalar(select(func.count()).select_from(Run).where(
            Run.account_id == run.account_id, Run.id != run.id, Run.status != "certified", streamed)) or 0)

    def _select(self, s: Session, run: Run, st: BeaconStatement) -> None:
        """Note the steps a statement selects (once: the same head again gets the same statement)."""
        planned = json.loads(s.get(LogLine, (run.id, 0)).line)["steps_planned"]
        have = set(s.scalars(select(OnlineStep.step).where(OnlineStep.run_id == run.id)))
        t = now_ms()
        s.add_all(OnlineStep(run_id=run.id, step=n, status="selected", selected_ms=t, has_samples=False)
                  for n in selected_steps(st, run.online_p, planned) if n not in have)  # type: ignore[arg-type]
        s.commit()

    def statements(self, s: Session, run: Run, up_to: int | None = None) -> list[bytes]:
        """The beacon's statements for a run, in order, as canonical JSON lines (those of heads of at
        most ``up_to`` records, if given)."""
        first = s.scalar(select(Head).where(Head.run_id == run.id, Head.size == 1))
        if first is None:
            return []
        try:
            found = self.beacon.run(s, first.root)
        except BeaconRefused:
            return []
        return [canonical_json(st) for st in found["statements"] if up_to is None or st["size"] <= up_to]

    def online_slot(self, s: Session, acct: Account, run_id: int, kind: str, step: int) -> OnlineStep:
        """The selected step an online upload is for, if it may come now: the run is the account's,
        takes online challenges and still trains, the beacon selected the step, and this upload has not
        come (checked before a byte of the body is stored, and again, atomically, when it is kept)."""
        run = self.run(s, run_id)
        if run.account_id != acct.id:
            raise ApiError(403, f"run {run_id} belongs to another account")
        if run.online_p is None:
            raise ApiError(409, f"run {run_id} takes no online challenges")
        if run.status == "rejected":
            raise ApiError(409, f"run {run_id} was rejected: {run.reason}")
        if run.status != "ticketed":
            raise ApiError(409, f"run {run_id} is {run.status}: its online uploads are closed")

        def find() -> OnlineStep | None:
            return s.scalar(select(OnlineStep).where(OnlineStep.run_id == run.id, OnlineStep.step == step)) \
                if type(step) is int else None

        row = find()
        if row is None:  # the server may have stopped between a statement and its rows: the statements decide
            for line in self.statements(s, run):
                self._select(s, run, BeaconStatement.from_json(parse_canonical_json(line)))
            row = find()
        if row is None:
            raise ApiError(404, f"the beacon selected no step {step} of run {run_id}")
        if row.state_sha256 if kind == "states" else row.has_samples:
            raise ApiError(409, f"the {'state' if kind == 'states' else 'samples'} of step {step} came already")
        return row

    def upload_online(self, s: Session, acct: Account, run_id: int, kind: str, step: int, upload: Upload) -> OnlineStep:
        """Keep the state before a selected step, or its batch's samples, uploaded while the run
        trains; once both are here the step is queued for replay. Each is taken once: the slot is
        claimed by a conditional update before the object is kept, so of parallel uploads exactly one
        is kept and the others get 409, leaving nothing behind."""
        row = self.online_slot(s, acct, run_id, kind, step)
        if kind == "states":
            claim = update(OnlineStep).where(OnlineStep.id == row.id, OnlineStep.state_sha256.is_(None)) \
                .values(state_sha256=upload.sha256)
        else:
            claim = update(OnlineStep).where(OnlineStep.id == row.id, OnlineStep.has_samples.is_(False)) \
                .values(has_samples=True)
        if s.execute(claim.execution_options(synchronize_session=False)).rowcount != 1:  # another upload of the same file won the race
            s.rollback()
            raise ApiError(409, f"the {'state' if kind == 'states' else 'samples'} of step {step} came already")
        # the row lock (PostgreSQL) or the write lock (SQLite) is held until the commit: the object is
        # kept before the row that names it is committed, and no second upload can pass in between
        self.store.keep(upload, online_key(row.run_id, kind, step, upload.sha256))
        s.refresh(row)
        if row.state_sha256 and row.has_samples and row.status == "selected":
            row.status = "ready"
            waiting = s.scalar(select(Job.id).where(Job.run_id == row.run_id, Job.kind == "online",
                                                    Job.status == "queued").limit(1))
            if waiting is None:
                queue.enqueue(s, row.run_id, "online", 1)
        s.commit()
        return row

    def run_bundle(self, s: Session, run: Run) -> Path:
        """The run's unpacked bundle on this machine (fetched from the store where it is not here),
        with, for a run audited online, the server's own statements in place of the trainer's copy:
        none can have been left out, on whichever machine the worker runs."""
        d = self.store.bundle_dir(run.id)
        if run.online_p is not None:
            tmp = self.store.scratch("statements.jsonl")  # written whole, then renamed into the bundle
            tmp.write_bytes(b"".join(line + b"\n" for line in self.statements(s, run)))
            (d / STATEMENTS).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, d / STATEMENTS)
        return d

    def _check_first_head(self, s: Session, run: Run, acct: Account, head: SignedTreeHead, manifest: str | None) -> dict:
        """The first streamed head covers exactly the manifest, which must use this ticket and track;
        returns the manifest."""
        if head.size != 1 or not isinstance(manifest, str):
            raise ApiError(400, "the first streamed head must be the manifest's (size 1), sent with the manifest")
        line = manifest.encode()
        if not same(leaf_hash(line), head.root):
            raise ApiError(400, "the manifest sent is not the one the tree head signs")
        try:
            m = parse_canonical_json(line)
        except (VerificationError, ValueError) as e:  # ValueError: not canonical JSON
            raise ApiError(400, f"manifest: {e}") from None
        self._check_manifest(s, run, acct, m)
        return m  # type: ignore[return-value]

    def _check_manifest(self, s: Session, run: Run, acct: Account, m: object) -> None:
        track = self.track(s, run.track)
        if not isinstance(m, dict) or m.get("type") != "manifest":
            raise ApiError(400, "the log's first record is not a manifest")
        if m.get("r") != run.r:
            raise ApiError(400, f"the run's r is not the one ticket {run.id} issued")
        if m.get("public_key") != acct.public_key:
            raise ApiError(400, "the run is signed by another key than the account's registered key")
        if m.get("task") != track.task or canonical_json(m.get("task_config")).decode() != track.config_json:
            raise ApiError(400, f"the run's recipe is not track {track.name!r}'s ({track.task} {track.config_json})")
        if m.get("data_root") != track.data_root:
            raise ApiError(400, "the run's data root is not the track's")
        online = m.get("online")
        if online is not None:
            try:
                online = parse_online(online, "manifest.online")
            except (VerificationError, ValueError) as e:
                raise ApiError(400, f"manifest: {e}") from None
            if m.get("state_every") != 1:
                raise ApiError(400, "a run with online challenges commits its state at every step (state_every 1)")
        if track.online_p is not None and (online is None or online["p"] < track.online_p):
            got = "none" if online is None else f"p = {online['p']:g}"
            raise ApiError(400, f"track {track.name!r} requires online challenges with p >= {track.online_p:g} (the run "
                                f"takes {got}): train with `witness train --leaderboard URL --track {track.name}`")

    def heads(self, s: Session, run_id: int) -> list[Head]:
        """The heads streamed for a run, in order."""
        return list(s.scalars(select(Head).where(Head.run_id == run_id).order_by(Head.size)))

    # --- submissions --------------------------------------------------------------------
    def upload_limit(self, s: Session, acct: Account, run_id: int | None = None, r: str | None = None) -> int:
        """The largest upload the account may send for its run (named by id or by its ticket's r): its
        track's declared limit, or the server's."""
        q = select(Run.track).where(Run.account_id == acct.id)
        if run_id is not None:
            q = q.where(Run.id == run_id)
        elif r is not None:
            q = q.where(Run.r == r.lower())
        else:
            return self.settings.max_upload
        track = s.scalar(q)
        spec = next((t for t in self.settings.tracks if t.name == track), None)
        return spec.max_upload if spec is not None and spec.max_upload else self.settings.max_upload

    def submit(self, s: Session, acct: Account, upload: Upload) -> Run:
        """Check an uploaded bundle (received unpacked) cheaply, keep it, and queue its certification."""
        sha256, size, staging = upload.sha256, upload.size, upload.staging
        try:
            if staging is None:
                raise ValueError("a submission is received unpacked")
            bundle_dir = staging / "bundle"
            try:
                bundle = open_bundle(bundle_dir)
            except VerificationError as e:
                raise ApiError(400, f"the bundle is not valid: {_hide(e, staging)}") from None
            m = bundle.manifest
            if m.public_key != acct.public_key:
                raise ApiError(400, "the bundle is signed by another key than the account's registered key")
            run = s.scalar(select(Run).where(Run.r == m.r.hex()))
            if run is None:
                raise ApiError(400, "no ticket of this leaderboard issued this run's r")
            if run.account_id != acct.id:
                raise ApiError(403, f"run {run.id} belongs to another account")
            if run.status != "ticketed":
                raise ApiError(409, f"run {run.id} was submitted already (status {run.status})")
            self._check_manifest(s, run, acct, m.raw)
            if not bundle.complete:
                raise ApiError(400, "the run is not finished: its end record is not signed")
            heads = self.heads(s, run.id)
            if not heads:
                raise ApiError(400, "no tree head was streamed while training: train with --leaderboard")
            for h in heads:
                if not bundle.log.extends(h.size, bytes.fromhex(h.root)):
                    # it contradicts a head its own key streamed: the log was rewritten
                    self._reject(s, run, bundle, sha256, f"the submitted log does not extend the tree head of size {h.size} "
                                         f"streamed at {h.received_ms} ms: it was rewritten after that head "
                                         "was published")
            self._check_cadence(s, run, heads, bundle, sha256)
            cert_path = staging / EVALUATION
            if not cert_path.exists():
                raise ApiError(400, f"the submission has no {EVALUATION} (run `witness eval` first)")
            try:
                cert = read_json_or_envelope(cert_path, MAX_CERTIFICATE_BYTES, "evaluation certificate")
            except VerificationError as e:
                raise ApiError(400, f"{EVALUATION}: {_hide(e, staging)}") from None
            if not isinstance(cert, dict):
                raise ApiError(400, f"{EVALUATION} is not a certificate")
            # Claim the run first: of two concurrent submissions only one gets past this line.
            t = now_ms()
            claimed = s.execute(update(Run).where(Run.id == run.id, Run.status == "ticketed")
                                .values(status="pending", submitted_ms=t)).rowcount
            if claimed != 1:
                s.rollback()
                raise ApiError(409, f"run {run.id} was submitted already")
            (staging / EVALUATION).write_bytes(canonical_json(cert) + b"\n")
            self.store.accept(run.id, upload)
            fh = bundle.final_head
            s.refresh(run)
            run.steps, run.final_size, run.final_root = len(bundle.steps), fh.size, fh.root.hex()
            run.final_state_hash = bundle.end.raw["final_state_hash"] if bundle.end else None
            run.bundle_sha256, run.bundle_bytes = sha256, size
            queue.enqueue(s, run.id, "certify", self.settings.certify_challenges)
            s.commit()
            return run
        finally:
            self.store.drop(upload)

    def _check_cadence(self, s: Session, run: Run, heads: list[Head], bundle, sha256: str) -> None:  # noqa: ANN001
        """Every stretch of the log was anchored while training: a head at least every
        ``max_head_gap`` records, up to and including the final head."""
        final_size = bundle.final_head.size
        sizes = [h.size for h in heads]
        gap = self.settings.max_head_gap
        worst = max((b - a for a, b in itertools.pairwise(sizes)), default=0)
        if sizes[-1] != final_size:
            self._reject(s, run, bundle, sha256, f"weakly time-anchored: the final tree head (size {final_size}) was not streamed "
                                 f"before submission; the last streamed head has size {sizes[-1]}")
        if worst > gap:
            self._reject(s, run, bundle, sha256, f"weakly time-anchored: the streamed heads leave {worst} records unanchored in a "
                                 f"row; this server asks for a signed head at least every {gap} records "
                                 "(checkpoint more often)")

    def _reject(self, s: Session, run: Run, bundle, sha256: str, reason: str) -> NoReturn:  # noqa: ANN001
        """Reject a submission in public (the run page shows the reason, the server signs it) and
        refuse the upload."""
        from .certification import record_decision

        run.status, run.reason = "rejected", reason
        run.submitted_ms = run.decided_ms = now_ms()
        run.bundle_sha256 = sha256
        fh = bundle.final_head
        run.steps, run.final_size, run.final_root = len(bundle.steps), fh.size, fh.root.hex()
        record_decision(self, s, run, bundle=bundle)
        s.commit()
        raise ApiError(400, f"run {run.id} rejected: {reason}")

    # --- self-regulation ----------------------------------------------------------------
    def request_challenges(self, s: Session, acct: Account, run_id: int, count: int) -> Job:
        """Queue more challenges on a certified run, within the requester's rate limit and the run's
        bound on queued work."""
        if type(count) is not int or not 1 <= count <= self.settings.rechallenge_max:
            raise ApiError(400, f"count must be an integer from 1 to {self.settings.rechallenge_max}")
        # Count and insert under a lock, or parallel requests all pass the same count: the
        # account's row on PostgreSQL (and the run's, for the run's bound), the whole database's
        # write lock on SQLite; both taken by this first write of the transaction.
        s.execute(update(Account).where(Account.id == acct.id)
                  .values(challenge_requests=Account.challenge_requests + 1)
                  .execution_options(synchronize_session=False))
        run = s.get(Run, run_id, with_for_update=True, populate_existing=True) if _valid_id(run_id) else None
        if run is None:
            raise ApiError(404, f"no run {run_id}")
        if run.status != "certified":
            raise ApiError(409, f"run {run_id} is {run.status}; only certified runs are re-challenged")
        since = now_ms() - 3600 * 1000
        recent = s.scalar(select(func.count()).select_from(Job).where(
            Job.requested_by == acct.id, Job.kind == "rechallenge", Job.created_ms > since))
        if recent >= self.settings.rechallenges_per_hour:
            raise ApiError(429, f"rate limit: {self.settings.rechallenges_per_hour} challenge requests per hour "
                                "per account; try again later")
        pending = s.scalar(select(func.coalesce(func.sum(Job.count), 0)).where(
            Job.run_id == run.id, Job.status.in_(("queued", "running"))))
        if pending + count > self.settings.max_queued_challenges:
            raise ApiError(429, f"run {run_id} has {pending} challenges waiting already; at most "
                                f"{self.settings.max_queued_challenges} may wait at once: try again when they are done")
        job = queue.enqueue(s, run.id, "rechallenge", count, acct.id)
        s.commit()
        return job
