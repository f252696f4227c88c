"""The beacon as a C2SP tlog-witness: it cosigns the checkpoints of registered runs' logs.

A run registers its log by its manifest (``POST logs``): the origin is ``commit.note.run_origin`` of the
run, and the log's key the manifest's (a type 0x01 note key named by the origin). ``add-checkpoint``
then follows c2sp.org/tlog-witness: the checkpoint must be signed by that key and consistent with the
latest one this witness cosigned for the origin, and the check and the update are one conditional
UPDATE, so of two requests from one old size exactly one is cosigned.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey
from sqlalchemy import func, or_, select, union, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..commit.attempts import AttemptsNote
from ..commit.cosignature import cosign, sign_as_witness
from ..commit.hashing import HASH_SIZE, same
from ..commit.merkle import EMPTY_ROOT, verify_consistency
from ..commit.note import (
    COSIGNATURE_V1,
    ED25519,
    Checkpoint,
    Note,
    NoteKey,
    NoteSignature,
    b64decode,
    is_run_origin,
    name_problem,
    origin_hash,
    parse_note,
    run_origin,
    verify_note_signature,
)
from ..commit.signing import public_hex
from ..errors import MalformedInput, VerificationError
from .db import BeaconRun
from .service import RUNS_PAGE, BeaconRefused, now_ms, read_manifest
from .witness_db import WitnessFork, WitnessLog

MAX_BODY = 64 << 10  # an add-checkpoint request: 63 proof lines and a checkpoint with a few signatures
MAX_PROOF_LINES = 63  # tlog-witness's bound
MAX_SIZE = (1 << 63) - 1  # a database's signed 64-bit integer; no run's log comes near
MAX_ORIGIN_BYTES = 80  # a configured log's origin (the tables' column; a run's origin is 76 bytes)
_OLD = re.compile(r"old (0|[1-9][0-9]{0,18})")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class WitnessConflict(BeaconRefused):
    """A 409: the old size is not the latest this witness cosigned for the origin (``latest``)."""

    def __init__(self, latest: int):
        super().__init__(409, f"the witness's latest cosigned size for this log is {latest}")
        self.latest = latest


@dataclass(frozen=True)
class AddCheckpoint:
    """An add-checkpoint request: the old size, the consistency proof and the signed checkpoint."""

    old: int
    proof: list[bytes]
    note: Note
    checkpoint: Checkpoint


def parse_add_checkpoint(body: bytes) -> AddCheckpoint:
    """Strictly parse an add-checkpoint body; ``BeaconRefused`` (400, or 413 over ``MAX_BODY``) if it is not one."""
    if len(body) > MAX_BODY:
        raise BeaconRefused(413, f"an add-checkpoint body is at most {MAX_BODY} bytes")
    head, sep, rest = body.partition(b"\n")
    try:
        old_line = head.decode("ascii")
    except UnicodeDecodeError:
        old_line = ""
    if not sep or not _OLD.fullmatch(old_line):
        raise BeaconRefused(400, "the body starts with the line 'old N' (N decimal, no leading zeroes)")
    proof: list[bytes] = []
    while True:
        line, sep, rest = rest.partition(b"\n")
        if not sep:
            raise BeaconRefused(400, "the proof lines end with an empty line before the checkpoint")
        if not line:
            break
        if len(proof) == MAX_PROOF_LINES:
            raise BeaconRefused(400, f"at most {MAX_PROOF_LINES} consistency proof lines")
        try:
            raw = b64decode(line.decode("ascii"), "proof line")
        except (UnicodeDecodeError, MalformedInput):
            raise BeaconRefused(400, f"consistency proof line {len(proof) + 1} is not a base64 hash") from None
        if len(raw) != HASH_SIZE:
            raise BeaconRefused(400, f"consistency proof line {len(proof) + 1} is not a {HASH_SIZE}-byte hash")
        proof.append(raw)
    try:
        note = parse_note(rest, MAX_BODY)
        checkpoint = Checkpoint.parse(note.text)
    except MalformedInput as e:
        raise BeaconRefused(400, str(e)) from None
    if checkpoint.size > MAX_SIZE:
        raise BeaconRefused(400, f"checkpoint: a size over {MAX_SIZE} is no run's log")
    return AddCheckpoint(int(old_line[4:]), proof, note, checkpoint)


def default_name(key: Ed25519PrivateKey) -> str:
    """The witness's name unless one is given: ``witness.beacon/`` and 16 hex digits of its key."""
    return "witness.beacon/" + public_hex(key.public_key())[:16]


@dataclass
class Witness:
    """Cosigns registered runs' checkpoints under ``name`` (``default_name`` if None) with ``cosigner``:
    cosignature/v1 with ``key`` (Ed25519, which also signs its attempts notes) unless an ML-DSA-44 key
    is given (tlog-cosignature's type 0x06)."""

    key: Ed25519PrivateKey
    name: str | None = None
    cosigner_key: MLDSA44PrivateKey | None = None
    # long-lived logs it is configured for, as tlog-witness has it (an operator's log: each run's heads are
    # entries of it): their verifier keys (type 0x01, named by the origin), besides the runs registered
    known: tuple[NoteKey, ...] = ()
    clock: Callable[[], float] = time.time  # the cosignatures' time (POSIX seconds)
    # called between a request's check and its update (a test holds two requests there to race them)
    checked: Callable[[], None] = field(default=lambda: None)

    def __post_init__(self) -> None:
        self.name = self.name or default_name(self.key)
        problem = name_problem(self.name)
        if problem:
            raise ValueError(f"witness name {self.name[:80]!r}: {problem}")
        self._known = {}
        for k in self.known:
            if k.alg != ED25519 or is_run_origin(k.name) or len(k.name.encode()) > MAX_ORIGIN_BYTES \
                    or k.name in self._known:
                raise ValueError(f"a configured log is an Ed25519 note key (0x01) named by its origin, at most "
                                 f"{MAX_ORIGIN_BYTES} bytes, not a run's, once each: not {k.vkey()[:100]!r}")
            self._known[k.name] = k

    @property
    def signing(self) -> Ed25519PrivateKey | MLDSA44PrivateKey:
        """The key it cosigns with."""
        return self.cosigner_key if self.cosigner_key is not None else self.key

    @property
    def cosigner(self) -> NoteKey:
        """The key its cosignatures verify under (type 0x04, or 0x06 for ML-DSA-44)."""
        return NoteKey.of(self.name, self.signing.public_key(), COSIGNATURE_V1)  # type: ignore[arg-type]

    @property
    def vkey(self) -> str:
        """The cosigner key as a vkey."""
        return self.cosigner.vkey()

    # --- registration ---------------------------------------------------------------------
    def register(self, s: Session, manifest: object) -> dict:
        """Register a run's log by its manifest line (again: the same answer)."""
        m = read_manifest(manifest)
        origin = run_origin(bytes.fromhex(m.run))
        row = s.scalar(select(WitnessLog).where(WitnessLog.origin == origin))
        if row is None:
            t = now_ms()
            row = WitnessLog(origin=origin, origin_hash=origin_hash(origin), run=m.run, public_key=m.public_key,
                             manifest=manifest, recipe=m.recipe, seed=m.seed, first_ms=t, last_ms=t, size=0,
                             root="", note=None, cosignature=None, forked=False)
            s.add(row)
            try:
                s.commit()
            except IntegrityError:  # registered at the same moment by another request: one row
                s.rollback()
                row = s.scalar(select(WitnessLog).where(WitnessLog.origin == origin))
                assert row is not None
        return log_json(row) | {"vkey": log_key(row).vkey()}

    def _configured(self, s: Session, key: NoteKey) -> WitnessLog:
        """The row of a configured log (made on its first checkpoint: it has no manifest, and prices no
        attempts: ``attempts`` is a run log's)."""
        row = s.scalar(select(WitnessLog).where(WitnessLog.origin == key.name))
        if row is None:
            t = now_ms()
            # (the run and recipe columns, unique or linked for run logs, name the origin: never a run's)
            tag = "log:" + origin_hash(key.name)[:60]
            s.add(WitnessLog(origin=key.name, origin_hash=origin_hash(key.name), run=tag, public_key=key.public.hex(),
                             manifest="", recipe=tag, seed=None, first_ms=t, last_ms=t, size=0, root="", note=None,
                             cosignature=None, forked=False))
            try:
                s.commit()
            except IntegrityError:  # its first checkpoints raced: one row
                s.rollback()
            row = s.scalar(select(WitnessLog).where(WitnessLog.origin == key.name))
            assert row is not None
        return row

    # --- add-checkpoint -------------------------------------------------------------------
    def add_checkpoint(self, s: Session, body: bytes) -> str:
        """Check and cosign a checkpoint (tlog-witness's add-checkpoint); the cosignature line.
        Raises ``BeaconRefused`` with the spec's status (``WitnessConflict`` for a 409)."""
        req = parse_add_checkpoint(body)
        cp = req.checkpoint
        configured = self._known.get(cp.origin)
        row = self._configured(s, configured) if configured is not None else \
            s.scalar(select(WitnessLog).where(WitnessLog.origin == cp.origin)) if is_run_origin(cp.origin) else None
        if row is None:
            raise BeaconRefused(404, f"unknown origin {cp.origin[:80]!r}: a log this witness is not configured for, "
                                "and no run's log registered with it (POST logs)")
        key = configured or log_key(row)
        try:
            if not verify_note_signature(req.note, key):
                raise BeaconRefused(403, f"the checkpoint carries no signature of the log's key {key.vkey()}")
        except VerificationError as e:
            raise BeaconRefused(403, f"the log's signature does not verify: {e}") from None
        if req.old > cp.size:
            raise BeaconRefused(400, f"old size {req.old} is over the checkpoint's size {cp.size}")
        signed = req.note.of_key(key)[0]
        for _ in range(2):  # a request overtaken by another is judged again against what that one stored
            line = self._try(s, row, req, signed)
            if line is not None:
                return line
            s.rollback()
            s.refresh(row)
        raise WitnessConflict(row.size)

    def _try(self, s: Session, row: WitnessLog, req: AddCheckpoint, signed: NoteSignature) -> str | None:
        """The cosignature for ``req`` against the latest checkpoint ``row`` holds, or None if another
        request updated it first; a refusal raises."""
        cp, old = req.checkpoint, req.old
        seen_size, seen_root = row.size, row.root
        latest = bytes.fromhex(seen_root) if seen_root else None  # None: nothing cosigned yet
        if latest is not None and cp.size == seen_size and not same(cp.root, latest):
            self._fork(s, row, "root", cp, signed)  # a second root for one size, signed: kept whatever old says
            # tlog-witness: a root other than the cosigned one at its size is a 409 Conflict (with the latest size)
            raise WitnessConflict(seen_size)
        if old != seen_size:
            raise WitnessConflict(seen_size)
        if cp.size == 0 and not same(cp.root, EMPTY_ROOT):
            raise BeaconRefused(422, "a checkpoint of size 0 has the empty tree's root")
        if old == 0 and req.proof:
            raise BeaconRefused(422, "from old size 0 the consistency proof is empty")
        if old == cp.size:
            if req.proof:
                raise BeaconRefused(422, "a checkpoint of the old size has an empty consistency proof")
            if latest is not None:  # the same checkpoint again (another root was refused above)
                # its cosignature, as first made: each checkpoint has one cosignature time, fixed when
                # it was first cosigned, which what is drawn for it is bound to
                return row.cosignature
        elif old > 0:
            try:
                verify_consistency(old, cp.size, latest, cp.root, req.proof)  # type: ignore[arg-type]
            except VerificationError as e:
                self._fork(s, row, "proof", cp, signed)
                raise BeaconRefused(422, f"the consistency proof from size {old} does not verify: {e}") from None
        self.checked()
        cosig = cosign(cp.text(), self.name, self.signing, int(self.clock()))  # type: ignore[arg-type]
        note = Note(cp.text(), (signed, cosig)).encode().decode()
        won = s.execute(update(WitnessLog)
                        .where(WitnessLog.id == row.id, WitnessLog.size == seen_size, WitnessLog.root == seen_root)
                        .values(size=cp.size, root=cp.root.hex(), note=note, cosignature=cosig.line(),
                                last_ms=now_ms())
                        .execution_options(synchronize_session=False)).rowcount
        if won != 1:
            return None  # that cosignature is never sent
        s.commit()
        s.expire(row)
        return cosig.line()

    def _fork(self, s: Session, row: WitnessLog, kind: str, cp: Checkpoint, signed: NoteSignature) -> None:
        """Keep the log's first refused fork (a proof of misbehaviour, as tlog-witness allows)."""
        if row.forked:
            return
        try:  # the insert is flushed by the update: both inside, where another request's first fork is met
            s.add(WitnessFork(log_id=row.id, kind=kind, size=cp.size, latest_note=row.note or "",
                              other_note=Note(cp.text(), (signed,)).encode().decode(), received_ms=now_ms()))
            s.execute(update(WitnessLog).where(WitnessLog.id == row.id).values(forked=True)
                      .execution_options(synchronize_session=False))
            s.commit()
        except IntegrityError:  # another request kept the first one
            s.rollback()

    # --- what anyone may read -------------------------------------------------------------
    def checkpoint(self, s: Session, ohash: str) -> bytes:
        """The latest cosigned checkpoint of the log whose origin hashes to ``ohash``, with both signatures."""
        row = self._log(s, ohash)
        if row.note is None:
            raise BeaconRefused(404, "this witness has cosigned no checkpoint of that log")
        return row.note.encode()

    def logs(self, s: Session, key: str, limit: int = RUNS_PAGE, offset: int = 0) -> list[dict]:
        """The logs registered under the log key ``key`` (hex), newest first, a page at a time."""
        if not isinstance(key, str) or not _HEX64.fullmatch(key.lower()):
            raise BeaconRefused(400, "key: a log's public key is 64 hex digits")
        rows = s.scalars(select(WitnessLog).where(WitnessLog.public_key == key.lower())
                         .order_by(WitnessLog.first_ms.desc(), WitnessLog.id.desc()).offset(offset).limit(limit))
        return [log_json(r) for r in rows]

    def log(self, s: Session, ohash: str) -> dict:
        """One log: its summary and the first fork it was refused for (both signed notes), if any."""
        row = self._log(s, ohash)
        fork = s.scalar(select(WitnessFork).where(WitnessFork.log_id == row.id))
        return log_json(row) | {"fork": None if fork is None else {
            "kind": fork.kind, "size": fork.size, "latest": fork.latest_note, "other": fork.other_note,
            "received_ms": fork.received_ms}}

    def attempts(self, s: Session, ohash: str) -> bytes:
        """A note signed by this witness (its cosigner key, its name): the log's latest size, how many other runs
        it links to it (key, recipe or seed), and the runs it prices in (every run of its seed)."""
        row = self._log(s, ohash)
        if row.origin in self._known:
            raise BeaconRefused(404, "a configured log is no run: its runs' attempts are read from its entries")
        others, priced = linked(s, row)
        text = AttemptsNote(row.origin, row.size, others, len(priced), tuple(priced)).text()
        # the cosigner key signs it (Ed25519: a type 0x01 note; its cosignatures' message starts "cosignature/v1",
        # never this text's first line; ML-DSA-44: with a context of its own), so a verifier pins one key
        return Note(text, (sign_as_witness(text, self.name, self.signing),)).encode()  # type: ignore[arg-type]

    @staticmethod
    def _log(s: Session, ohash: str) -> WitnessLog:
        row = s.scalar(select(WitnessLog).where(WitnessLog.origin_hash == ohash)) \
            if isinstance(ohash, str) and _HEX64.fullmatch(ohash) else None
        if row is None:
            raise BeaconRefused(404, f"this witness knows no log whose origin hashes to {str(ohash)[:64]!r}")
        return row


def log_key(row: WitnessLog) -> NoteKey:
    """The key a registered log's checkpoints are signed with: the run's, named by the origin."""
    return NoteKey(row.origin, ED25519, bytes.fromhex(row.public_key))


def linked(s: Session, row: WitnessLog) -> tuple[int, list[str]]:
    """How many other runs are linked to this log's (``Beacon._linked``'s rules, over the witness's logs
    and the beacon's runs, a run in both counted once), and the ids of those priced in as attempts at
    it: every run of the same run seed, whatever its recipe or key."""
    others = union(
        select(WitnessLog.run).where(WitnessLog.run != row.run, or_(
            WitnessLog.public_key == row.public_key, WitnessLog.recipe == row.recipe, WitnessLog.seed == row.seed)),
        select(BeaconRun.run).where(BeaconRun.run != row.run, or_(
            BeaconRun.public_key == row.public_key, BeaconRun.recipe == row.recipe, BeaconRun.seed == row.seed)),
    ).subquery()
    priced = union(select(WitnessLog.run).where(WitnessLog.run != row.run, WitnessLog.seed == row.seed),
                   select(BeaconRun.run).where(BeaconRun.run != row.run, BeaconRun.seed == row.seed))
    return int(s.scalar(select(func.count()).select_from(others)) or 0), sorted(s.scalars(priced))


def log_json(r: WitnessLog) -> dict:
    """A registered log's public summary (never its seed)."""
    return {"origin": r.origin, "origin_hash": r.origin_hash, "run": r.run, "public_key": r.public_key,
            "recipe": r.recipe, "size": r.size, "cosigned": r.note is not None, "first_ms": r.first_ms,
            "last_ms": r.last_ms, "forked": r.forked}
