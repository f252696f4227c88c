"""What the leaderboard does, apart from HTTP: accounts, tickets, streamed heads, submissions,
re-challenge requests. Every failure is an ``ApiError`` with an HTTP status and a clear message."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import secrets
from typing import NoReturn

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ..beacon.service import Beacon
from ..bundle.reader import open_bundle
from ..commit.dsse import read_json_or_envelope
from ..commit.hashing import canonical_json
from ..commit.note import NoteKey
from ..commit.signing import (
    load_or_create_key,
    parse_public_key,
    public_hex,
)
from ..errors import VerificationError
from ..store import EVALUATION, Upload, open_store
from . import queue
from .common import ApiError, Settings, _describe, _hide, _lock_writes, _valid_id, token_hash
from .contests import ContestRuns
from .db import (
    Account,
    Head,
    Job,
    Run,
    Track,
    make_engine,
    migrate,
    now_ms,
    sessions,
)
from .streaming import StreamedRuns
from .witnessed import WitnessedRuns

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_CERTIFICATE_BYTES = 256 * 1024 * 1024




class Leaderboard(StreamedRuns, WitnessedRuns, ContestRuns):
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
        w = self.settings.witnessing
        if w is not None and not w.vkey:  # the operator log's note key, which its witnessed tracks pin
            w = self.settings.witnessing = dataclasses.replace(
                w, vkey=NoteKey.of(w.origin, self.operator_key().public_key()).vkey())
        with self.Session() as s:
            for spec in self.settings.tracks:
                row = s.get(Track, spec.name)
                resolved = spec.resolve(w)
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
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
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

    # --- tickets ---------------------------------------------------------------------------
    def track(self, s: Session, name: str) -> Track:
        """A registered track, or 404."""
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):  # (a NUL would reach PostgreSQL's text)
            raise ApiError(404, f"no track {str(name)[:64]!r}")
        t = s.get(Track, name)
        if t is None:
            raise ApiError(404, f"no track {name!r}")
        return t

    def ticket(self, s: Session, acct: Account, track_name: str, title: str | None = None,
               description: str | None = None, code_url: str | None = None, method: int | None = None) -> Run:
        """Issue a run ticket: the server's r, so the run seed H(data root ‖ r) is fixed from now on (and on a
        contest track, the method the run must be trained with)."""
        method_id = self.ticket_method(s, acct, self.track(s, track_name), method)
        run = Run(account_id=acct.id, track=track_name, r=self.randomness(32).hex(), status="ticketed",
                  ticket_ms=now_ms(), challenges_passed=0, method_id=method_id)
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
            cert_path, cert = staging / EVALUATION, None
            if run.method_id is not None:  # a contest run is scored by the server, blind: the trainer's scores are not kept
                cert_path.unlink(missing_ok=True)
            elif not cert_path.exists():
                raise ApiError(400, f"the submission has no {EVALUATION} (run `witness eval` first)")
            else:
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
            if cert is not None:
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
