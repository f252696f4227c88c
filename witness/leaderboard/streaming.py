"""The leaderboard's runs while they train: streamed heads (each checked to extend the last and
stamped by the beacon), the records they cover, and the online uploads of the steps the beacon
selected. ``Leaderboard`` takes these methods from ``StreamedRuns``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..beacon.service import FINAL_EXTENSION, BeaconRefused
from ..bundle.layout import MAX_RECORD_BYTES, STATEMENTS
from ..bundle.schema import parse_online
from ..commit.beacon import BeaconStatement, selected_steps
from ..commit.hashing import canonical_json, from_hex, leaf_hash, parse_canonical_json, same
from ..commit.log import RunLog
from ..commit.merkle import verify_consistency
from ..commit.signing import (
    SignedTreeHead,
    public_key_from_hex,
)
from ..data.order import derive_run_seed
from ..errors import VerificationError
from ..store import Upload, online_key
from . import queue
from .common import MAX_CONSISTENCY_HASHES, MAX_ID, ApiError, _lock_run
from .db import (
    Account,
    Head,
    Job,
    LogLine,
    OnlineStep,
    OnlineWindow,
    Run,
    Track,
    now_ms,
    run_manifest,
)


class StreamedRuns:
    """The streaming half of ``Leaderboard`` (it holds ``settings``, ``store``, ``beacon`` and ``Session``, and
    ``witnessed`` and the windows of ``witness.leaderboard.witnessed``)."""

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

    def stamp(self, s: Session, head: Head, consistency: list, manifest: str | None) -> dict | None:
        """The beacon's signed statement for a head the server stamped (its randomness selects the
        steps of the head's window for online challenges, which the run then uploads)."""
        first = s.scalar(select(Head).where(Head.run_id == head.run_id, Head.size == 1))
        if first is None:
            raise ApiError(409, "the run's first streamed head is missing")
        run = s.get(Run, head.run_id)
        if self.witnessed(s.get(Track, run.track)) is not None:
            return None  # a witnessed run's draws come from drand, once the track's witnesses cosigned its head
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
        planned = run_manifest(s, run.id)["steps_planned"]
        have = set(s.scalars(select(OnlineStep.step).where(OnlineStep.run_id == run.id)))
        t = now_ms()
        s.add_all(OnlineStep(run_id=run.id, step=n, status="selected", selected_ms=t, has_samples=False)
                  for n in selected_steps(st, run.online_p, planned) if n not in have)  # type: ignore[arg-type]
        s.commit()

    def statements(self, s: Session, run: Run, up_to: int | None = None) -> list[bytes]:
        """The beacon's statements for a run, in order, as canonical JSON lines (those of heads of at
        most ``up_to`` records, if given); a witnessed run's windows."""
        if self.witnessed(s.get(Track, run.track)) is not None:
            return self.window_lines(s, run, up_to)
        first = s.scalar(select(Head).where(Head.run_id == run.id, Head.size == 1))
        if first is None:
            return []
        try:
            found = self.beacon.run(s, first.root)
        except BeaconRefused:
            return []
        return [canonical_json(st) for st in found["statements"] if up_to is None or st["size"] <= up_to]

    def _uploading(self, s: Session, acct: Account, run_id: int) -> Run:
        """The run an online upload is for, if it may take one now: the account's, taking online
        challenges, still training."""
        run = self.run(s, run_id)
        if run.account_id != acct.id:
            raise ApiError(403, f"run {run_id} belongs to another account")
        if run.online_p is None:
            raise ApiError(409, f"run {run_id} takes no online challenges")
        if run.status == "rejected":
            raise ApiError(409, f"run {run_id} was rejected: {run.reason}")
        if run.status != "ticketed":
            raise ApiError(409, f"run {run_id} is {run.status}: its online uploads are closed")
        return run

    def online_slot(self, s: Session, acct: Account, run_id: int, kind: str, step: int) -> OnlineStep | range:
        """The selected step an online upload is for, if it may come now: the run is the account's,
        takes online challenges and still trains, the beacon selected the step, and this upload has not
        come (checked before a byte of the body is stored, and again, atomically, when it is kept). For
        a window's chunk openings (``chunks``, ``step`` the head size it closes at): the steps of the window."""
        if kind == "chunks":
            return self.openings_slot(s, acct, run_id, step)
        run = self._uploading(s, acct, run_id)

        def find() -> OnlineStep | None:
            return s.scalar(select(OnlineStep).where(OnlineStep.run_id == run.id, OnlineStep.step == step)) \
                if type(step) is int else None

        row = find()
        # the server may have stopped between a statement and its rows: the statements decide (a witnessed
        # window's rows are committed with it)
        if row is None and self.witnessed(s.get(Track, run.track)) is None:
            for line in self.statements(s, run):
                self._select(s, run, BeaconStatement.from_json(parse_canonical_json(line)))
            row = find()
        if row is None:
            raise ApiError(404, f"the beacon selected no step {step} of run {run_id}")
        if row.state_sha256 if kind == "states" else row.has_samples:
            raise ApiError(409, f"the {'state' if kind == 'states' else 'samples'} of step {step} came already")
        return row

    def openings_slot(self, s: Session, acct: Account, run_id: int, size: int) -> range:
        """The steps of the window whose chunk openings may come now: the run commits its parameters'
        chunks, this server's beacon stamped the head of ``size`` records for it, opening steps, and
        its openings have not come."""
        run = self._uploading(s, acct, run_id)
        manifest = run_manifest(s, run.id)
        if "chunks" not in (manifest.get("online") or {}):
            raise ApiError(409, f"run {run_id} commits no parameter chunks: it has no openings to upload")
        if self.witnessed(s.get(Track, run.track)) is not None:
            st = self.window_at(s, run, size) if type(size) is int else None
            if st is None:
                raise ApiError(404, f"no window of run {run_id} closing at size {size} came")
        else:
            first = s.scalar(select(Head.root).where(Head.run_id == run.id, Head.size == 1))
            found = self.beacon.statement_at(s, first, size) if first is not None else None
            if found is None:
                raise ApiError(404, f"the beacon stamped no head of size {size} for run {run_id}")
            st = BeaconStatement.from_json(found)
        steps = st.window(manifest["steps_planned"])
        if not len(steps):
            raise ApiError(409, f"the head of size {size} opens no step of run {run_id}")
        if s.scalar(select(OnlineWindow.id).where(OnlineWindow.run_id == run.id, OnlineWindow.size == size)):
            raise ApiError(409, f"the chunk openings of the window closing at size {size} came already")
        return steps

    def openings_limit(self, s: Session, run_id: int, steps: range) -> int:
        """The most bytes the openings of a window of ``steps`` can take: its states (one more than its
        steps), each with its chunks and their paths (at most 41 nodes: a tree of 2^40 chunks), and a
        header (the caller caps it at the track's upload limit too)."""
        online = run_manifest(s, run_id).get("online") or {}
        chunks, size = online.get("chunks", 0), online.get("chunk_bytes", 0)
        return (len(steps) + 1) * chunks * (size + 41 * 32) + (1 << 16)

    def upload_openings(self, s: Session, acct: Account, run_id: int, size: int, upload: Upload) -> OnlineWindow:
        """Keep a window's chunk openings, uploaded while the run trains, and queue a live round for
        them. Taken once: the row is inserted before the object is kept, so of parallel uploads exactly
        one is kept and the others get 409."""
        steps = self.openings_slot(s, acct, run_id, size)
        row = OnlineWindow(run_id=run_id, size=size, steps=len(steps), sha256=upload.sha256, received_ms=now_ms(),
                           status="uploaded")
        s.add(row)
        try:
            s.flush()
        except IntegrityError:  # another upload of the same window won the race
            s.rollback()
            raise ApiError(409, f"the chunk openings of the window closing at size {size} came already") from None
        self.store.keep(upload, online_key(run_id, "chunks", size, upload.sha256))
        if s.scalar(select(Job.id).where(Job.run_id == run_id, Job.kind == "online", Job.status == "queued")
                    .limit(1)) is None:
            queue.enqueue(s, run_id, "online", 1)
        s.commit()
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
        if run.method_id is not None:
            self.check_method_manifest(s, run, m)  # type: ignore[attr-defined]
        elif m.get("task") != track.task or canonical_json(m.get("task_config")).decode() != track.config_json:
            raise ApiError(400, f"the run's recipe is not track {track.name!r}'s ({track.task} {track.config_json})")
        if m.get("data_root") != track.data_root:
            raise ApiError(400, "the run's data root is not the track's")
        planned = m.get("steps_planned")
        if type(planned) is not int or not 1 <= planned <= MAX_ID:  # the beacon's selection counts on it
            raise ApiError(400, "manifest: steps_planned must be a whole number of steps, 1 to 2^31 - 1")
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
        conf = self.witnessed(track)
        chain = conf["drand"]["chain"]["hash"] if conf is not None else None
        if online is not None and online.get("drand") != chain:
            raise ApiError(400, f"track {track.name!r} draws its online challenges from "
                                + (f"the drand chain {chain}, through its witnesses" if chain else "this server's beacon")
                                + f", and the run's manifest names {online.get('drand') or 'the beacon'}")
        if m.get("run_seed") != derive_run_seed(bytes.fromhex(track.data_root), bytes.fromhex(run.r)).hex():
            # (a run seed of another's run would have this run counted among that one's attempts)
            raise ApiError(400, "the run's seed is not H(data root || r) of its ticket")

    def heads(self, s: Session, run_id: int) -> list[Head]:
        """The heads streamed for a run, in order."""
        return list(s.scalars(select(Head).where(Head.run_id == run_id).order_by(Head.size)))
