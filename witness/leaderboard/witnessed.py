"""Witnessed tracks: online challenges drawn by drand and cosigned by public witnesses, through the
operator log the leaderboard runs for its runs (``witness.beacon.operator``, mounted at ``/api/operator``).

A run of such a track streams its heads and records as the beacon's online tracks do, enters each
window's head in the server's operator log (whose checkpoints the track's witnesses cosign), waits for
the drand round its closing record named, and sends the window here (``POST /api/runs/{id}/windows``).
The server checks it on arrival, notes the steps its draw selects, and takes their uploads; its workers
replay them while the run trains, under the same trust a reader pins with ``witness verify --operator``:
the operator log's key, the track's witnesses and quorum, and the drand chain.

The server is the operator: it knows when each head reached its log, so a cosignature dated before that
(a witness backdating it, to let a round that was already known count) is refused on arrival.
"""

from __future__ import annotations

import json
import threading

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..beacon.operator import ENTRIES_PAGE, OperatorLog, read_entries
from ..beacon.operator_db import OperatorEntry
from ..beacon.witness_client import WitnessClient
from ..commit.beacon import run_id as run_id_of
from ..commit.drand import ChainInfo, round_time, verify_round
from ..commit.hashing import canonical_json, parse_canonical_json, same
from ..commit.log import RunLog
from ..commit.note import Checkpoint, NoteKey, parse_note, run_origin
from ..commit.signing import load_or_create_key
from ..commit.window import WitnessedWindow
from ..errors import MalformedInput, VerificationError
from ..verify.online import WitnessTrust, earliest_cosignatures
from ..verify.operator import OperatorChain, OperatorTrust
from .common import ApiError, _lock_run
from .db import Head, LogLine, Run, Track, WitnessedWindowRow, now_ms

_BUILD = threading.Lock()


class WitnessedRuns:
    """The witnessed half of ``Leaderboard`` (it holds ``settings``, ``store`` and ``Session``)."""

    _operator: OperatorLog | None = None

    def operator_key(self) -> Ed25519PrivateKey:
        """The operator log's key (created on first start, in the store beside the server's key)."""
        return load_or_create_key(self.store.root / "operator_key.pem")  # type: ignore[attr-defined]

    def operator_log(self) -> OperatorLog:
        """The operator log this server runs (built at first use: only the serving process appends)."""
        w = self.settings.witnessing  # type: ignore[attr-defined]
        if w is None:
            raise ApiError(404, "this server runs no operator log (it has no witnessed tracks)")
        with _BUILD:
            if self._operator is None:
                clients = [WitnessClient(url, vkey=vkey, prefix="", ask_key=False) for url, vkey in w.witnesses]
                self._operator = OperatorLog(self.Session, self.operator_key(), w.origin,  # type: ignore[attr-defined]
                                             clients, w.quorum)
        return self._operator

    def admit_operator(self, authorization: str | None, manifest: str | None,
                       head: tuple[str, str] | None) -> None:
        """Who may write into the operator log: an account, for its own run of a witnessed track that still
        trains, whose manifest it streamed here first (``manifest``: a registration), and only a head it
        streamed here (``head``: the run's id, hex, and the checkpoint note). Else ``ApiError``: a stranger
        registering runs of another's seed would price that run down, a run that drew windows before the
        server knew it would be no attempt the server counts, and heads the server never received would
        grow the log every worker reads (and every witness is asked to cosign)."""
        scheme, _, token = (authorization or "").partition(" ")
        with self.Session() as s:  # type: ignore[attr-defined]
            acct = self.authenticate(s, token if scheme.lower() == "bearer" else None)  # type: ignore[attr-defined]
            # a run's id is the root of its first streamed head (the manifest's leaf): one row, found by index
            rid = run_id_of(manifest.encode()).hex() if manifest is not None else head[0]  # type: ignore[index]
            run = s.scalar(select(Run).join(Head, Head.run_id == Run.id).where(
                Head.size == 1, Head.root == rid, Run.account_id == acct.id))
            if run is None:
                raise ApiError(403, "the operator log takes only your own runs of witnessed tracks, once their manifest "
                                    "was streamed to POST /api/runs/ID/heads")
            if run.status != "ticketed":
                raise ApiError(409, f"run {run.id} is {run.status}: its log is closed")
            if self.witnessed(s.get(Track, run.track)) is None:
                raise ApiError(409, f"run {run.id}'s track takes its online challenges from the server's beacon")
            if head is not None:
                try:
                    cp = Checkpoint.parse(parse_note(head[1].encode()).text)
                except (MalformedInput, ValueError) as e:
                    raise ApiError(400, f"head: {e}") from None
                if s.scalar(select(Head.id).where(Head.run_id == run.id, Head.size == cp.size,
                                                  Head.root == cp.root.hex())) is None:
                    raise ApiError(409, f"the run's head of size {cp.size} (that root) was not streamed to POST "
                                        f"/api/runs/{run.id}/heads first")

    @staticmethod
    def witnessed(track: Track) -> dict | None:
        """A track's witnessed trust (its stored JSON), or None for a track of the server's beacon."""
        return json.loads(track.witnessed_json) if track.witnessed_json else None

    def witness_trust(self, s: Session, run: Run) -> WitnessTrust | None:
        """What the server's workers pin for a witnessed run: the track's witnesses and quorum, the drand
        chain, the operator log's key, its entries read from this database, and the account's other runs
        that were not certified (each an attempt at this one, as the beacon's tracks count them)."""
        conf = self.witnessed(s.get(Track, run.track))
        if conf is None:
            return None
        others = frozenset(bytes.fromhex(root) for root in s.scalars(  # (a run's id: its first head's root)
            select(Head.root).join(Run, Run.id == Head.run_id).where(
                Head.size == 1, Run.account_id == run.account_id, Run.id != run.id, Run.status != "certified")))
        sessions = self.Session  # type: ignore[attr-defined]

        def entries(start: int) -> list[bytes]:
            return [e.encode("utf-8") for e in read_entries(sessions, start, ENTRIES_PAGE)]

        return WitnessTrust(tuple(NoteKey.parse(v) for v in conf["witnesses"]), conf["quorum"],
                            ChainInfo.from_json(conf["drand"]["chain"]),
                            OperatorTrust(NoteKey.parse(conf["operator"]), entries, others))

    def online_trust(self, s: Session, run: Run) -> dict:
        """Whom a run's online challenges are trusted from, as ``Trust`` fields: the track's witnesses, or
        this server's beacon."""
        witnesses = self.witness_trust(s, run)
        return {"witnesses": witnesses} if witnesses is not None else {"beacon_key": self.public_key}  # type: ignore[attr-defined]

    def window_lines(self, s: Session, run: Run, up_to: int | None = None) -> list[bytes]:
        """A witnessed run's windows, in order, as the lines of its bundle's statements (those closing at
        a head of at most ``up_to`` records, if given)."""
        q = select(WitnessedWindowRow.line).where(WitnessedWindowRow.run_id == run.id)
        if up_to is not None:
            q = q.where(WitnessedWindowRow.size <= up_to)
        return [line.encode() for line in s.scalars(q.order_by(WitnessedWindowRow.size))]

    def window_at(self, s: Session, run: Run, size: int) -> WitnessedWindow | None:
        """The window closing at the head of ``size`` records, if it came."""
        line = s.scalar(select(WitnessedWindowRow.line).where(WitnessedWindowRow.run_id == run.id,
                                                             WitnessedWindowRow.size == size))
        return WitnessedWindow.from_json(parse_canonical_json(line.encode())) if line else None

    def add_window(self, s: Session, acct, run_id: int, obj: object) -> WitnessedWindowRow:  # noqa: ANN001
        """Keep a window a witnessed run sent as it trains, once checked (see ``check_arrival``), and note
        the steps its draw selects (their uploads may then come). The same window again: its row."""
        run = self._uploading(s, acct, run_id)  # type: ignore[attr-defined]
        conf = self.witnessed(s.get(Track, run.track))
        if conf is None:
            raise ApiError(409, f"run {run_id}'s track takes its online challenges from the server's beacon, not "
                                "witnessed windows")
        _lock_run(s, run.id)
        try:
            w = WitnessedWindow.from_json(obj)
        except (MalformedInput, VerificationError, ValueError) as e:
            raise ApiError(400, f"window: {e}") from None
        line = canonical_json(w.to_json()).decode()
        old = s.scalar(select(WitnessedWindowRow).where(WitnessedWindowRow.run_id == run.id,
                                                        WitnessedWindowRow.size == w.size))
        if old is not None:
            if old.line == line:
                return old
            raise ApiError(409, f"another window closing at size {w.size} came already")
        lines = [x.encode() for x in s.scalars(select(LogLine.line).where(LogLine.run_id == run.id,
                                                                         LogLine.position < w.size)
                                              .order_by(LogLine.position))]
        if not lines or len(lines) < w.size:
            raise ApiError(409, f"the records of the window closing at size {w.size} have not been streamed")
        try:
            cosigners, on_time = check_arrival(w, lines, conf, lambda size: self._entered_ms(s, w.run, size))
        except (MalformedInput, VerificationError, ValueError) as e:
            raise ApiError(400, f"the window closing at size {w.size} does not verify: {e}") from None
        row = WitnessedWindowRow(run_id=run.id, size=w.size, round=w.round, line=line, on_time=on_time,
                                 cosigners_json=json.dumps(cosigners), received_ms=now_ms())
        s.add(row)
        try:
            s.flush()
        except IntegrityError:
            s.rollback()
            raise ApiError(409, f"another window closing at size {w.size} came already") from None
        self._select(s, run, w)  # type: ignore[attr-defined] - its steps, with the row (one commit)
        return row

    @staticmethod
    def _entered_ms(s: Session, run: bytes, size: int) -> int | None:
        """When the operator log took the run's head of ``size`` records."""
        return s.scalar(select(OperatorEntry.received_ms).where(
            OperatorEntry.kind == "head", OperatorEntry.run == run.hex(), OperatorEntry.size == size))

    def windows_page(self, s: Session, run: Run) -> list[dict]:
        """A witnessed run's windows for its page: where each closes, its drand round, who cosigned it in time."""
        return [{"size": r.size, "round": r.round, "cosigners": json.loads(r.cosigners_json), "on_time": r.on_time,
                 "received_ms": r.received_ms}
                for r in s.scalars(select(WitnessedWindowRow).where(WitnessedWindowRow.run_id == run.id)
                                   .order_by(WitnessedWindowRow.size))]


def check_arrival(w: WitnessedWindow, lines: list[bytes], conf: dict, entered_ms) -> tuple[list[str], bool]:  # noqa: ANN001
    """Check a window against the run's streamed records (``lines``, its manifest first) and the track's
    trust ``conf``: the run's checkpoint signed by its key and entered in the operator log, the operator
    checkpoint signed by the log's key, the round its closing record names signed by the drand chain, and
    K of the track's witnesses cosigning, none dated before the head reached the log (``entered_ms(size)``).
    Returns the witnesses that cosigned in time to count, and whether K of them did."""
    run = run_id_of(lines[0])
    where = f"the window closing at size {w.size}"
    if not same(w.run, run):
        raise VerificationError(f"{where} names another run")
    cp = Checkpoint.parse(parse_note(w.checkpoint).text)
    log = RunLog(lines[:w.size])
    if cp.origin != run_origin(run) or cp.size != w.size or cp.extensions or not same(log.root(w.size), cp.root):
        raise VerificationError(f"{where}: its checkpoint is not this run's streamed log at size {w.size}")
    closing = parse_canonical_json(lines[w.size - 1]) if w.size >= 2 else {}
    if not isinstance(closing, dict) or closing.get("round") != w.round:
        raise VerificationError(f"{where}: the record that closes it names another drand round than {w.round}")
    chain = ChainInfo.from_json(conf["drand"]["chain"])
    verify_round(chain, w.round, w.drand_signature)
    manifest = parse_canonical_json(lines[0])
    key = bytes.fromhex(manifest["public_key"])  # type: ignore[index]
    opchain = OperatorChain(OperatorTrust(NoteKey.parse(conf["operator"])), run, key, b"",
                            lambda size, root: size <= len(log) and same(log.root(size), root), len(lines))
    note = opchain.window(w, where)
    entered = entered_ms(w.size)
    if entered is None:
        raise VerificationError(f"{where}: the operator log holds no head of the run of that size")
    due = round_time(chain, w.round)
    times = earliest_cosignatures(note, [NoteKey.parse(v) for v in conf["witnesses"]])
    for name, t in times.items():
        if t * 1000 < entered - chain.period * 1000:
            raise VerificationError(f"{where}: witness {name} dated its cosignature {t}, before its head "
                                    f"reached the operator log ({entered // 1000}): a backdated cosignature")
    if len(times) < conf["quorum"]:
        raise VerificationError(f"{where} is cosigned by {len(times)} of the {conf['quorum']} witness(es) its track "
                                "needs")
    in_time = [name for name, t in times.items() if t + chain.period < due]
    return in_time, len(in_time) >= conf["quorum"]
