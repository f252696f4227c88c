"""An operator's log (``witness.commit.operator``), served: runs register, their heads become entries, and
each checkpoint of the log goes to the configured witnesses through tlog-witness's add-checkpoint alone.

One process appends (``witness operator serve`` has no workers): an entry's index is its place in the
one tree kept in memory, and the entries are written before any checkpoint names them. Heads that
arrive while a checkpoint is being cosigned wait for the next one, which holds them all: many runs share
the log, and none waits on another's windows, only on the witnesses' round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..commit.hashing import same
from ..commit.merkle import MerkleTree, verify_consistency
from ..commit.note import (
    Checkpoint,
    Note,
    NoteKey,
    NoteSignature,
    name_problem,
    parse_note,
    sign_note,
)
from ..commit.operator import HeadEntry, entry_leaf, head_entry, parse_entry, run_entry
from ..errors import MalformedInput, VerificationError
from .operator_db import OperatorCheckpoint, OperatorEntry
from .service import BeaconRefused, now_ms
from .witness_client import WitnessClient, WitnessError

SessionFactory = Callable[[], AbstractContextManager[Session]]
ENTRIES_PAGE = 100  # entries a request may read at once
PAGE_BYTES = 1 << 18  # and their bytes (an entry is at most 33 KiB: escaped twice, a page stays under 1 MiB)
MAX_PROOF = 63  # a run's consistency proof (tlog-witness's bound)


class OperatorLog:
    """The log of ``origin`` signed by ``key``, cosigned by ``witnesses`` (at least ``required`` of them
    each checkpoint), its rows in ``sessions``' database."""

    def __init__(self, sessions: SessionFactory, key: Ed25519PrivateKey, origin: str,
                 witnesses: list[WitnessClient], required: int | None = None, clock: Callable[[], float] = time.time):
        problem = name_problem(origin)
        if problem:
            raise ValueError(f"origin {origin[:80]!r}: {problem}")
        if not witnesses:
            raise ValueError("an operator log is cosigned by at least one witness")
        self.sessions, self.key, self.origin, self.witnesses = sessions, key, origin, witnesses
        self.required = len(witnesses) if required is None else required
        if not 1 <= self.required <= len(witnesses):
            raise ValueError(f"the quorum is 1 to {len(witnesses)} witnesses, not {self.required}")
        self.vkey = NoteKey.of(origin, key.public_key())
        self.clock = clock
        self._append, self._publish = threading.Lock(), threading.Lock()
        with sessions() as s:  # the tree of every entry written, in order
            self.tree = MerkleTree([entry_leaf(e) for e in s.scalars(select(OperatorEntry.entry)
                                                                     .order_by(OperatorEntry.index))])
        self._seen: dict[int, int] = {}  # what each witness last cosigned, as far as known here

    # --- entries --------------------------------------------------------------------------
    def register(self, manifest_line: bytes) -> dict:
        """Append a run's registration (again: the index it has); ``BeaconRefused`` 400 for a bad manifest."""
        try:
            run = run_entry(manifest_line)
        except MalformedInput as e:
            raise BeaconRefused(400, str(e)) from None
        with self._append, self.sessions() as s:
            row = s.scalar(select(OperatorEntry).where(OperatorEntry.kind == "run", OperatorEntry.run == run.run.hex()))
            if row is None:
                row = self._add(s, run.entry(), "run", run.run.hex(), run.seed_tag.hex() if run.seed_tag else None, 0)
            return {"index": row.index, "run": row.run, "origin": self.origin}

    def add_head(self, run: str, note: bytes, old: int, proof: list[bytes]) -> int:
        """Append one of a registered run's heads, consistent (``proof``, from size ``old``, the run's
        latest head here) with the heads it has here; its index. The same head again: its index."""
        try:
            head = head_entry(bytes.fromhex(run) if isinstance(run, str) and len(run) == 64 else b"", note)
        except (MalformedInput, ValueError) as e:
            raise BeaconRefused(400, f"head: {e}") from None
        if len(proof) > MAX_PROOF:
            raise BeaconRefused(400, f"a consistency proof has at most {MAX_PROOF} hashes")
        with self._append, self.sessions() as s:
            reg = s.scalar(select(OperatorEntry).where(OperatorEntry.kind == "run", OperatorEntry.run == run))
            if reg is None:
                raise BeaconRefused(404, f"run {run[:64]} is not registered in this log: register it first")
            try:
                head.verify(parse_entry(reg.entry).public_key)  # type: ignore[union-attr]
            except (MalformedInput, VerificationError) as e:
                raise BeaconRefused(403, f"the head is not signed by the run's key: {e}") from None
            for row in s.scalars(select(OperatorEntry).where(OperatorEntry.kind == "head", OperatorEntry.run == run,
                                                             OperatorEntry.size == head.checkpoint.size)):
                if row.entry == head.entry():  # sent again (an answer lost, a resumed run): its index
                    return row.index
            latest = s.scalar(select(OperatorEntry).where(OperatorEntry.kind == "head", OperatorEntry.run == run)
                              .order_by(OperatorEntry.size.desc()).limit(1))
            if latest is not None:
                known = parse_entry(latest.entry)
                assert isinstance(known, HeadEntry)
                if old != known.checkpoint.size:
                    raise BeaconRefused(409, f"the run's latest head here is of size {known.checkpoint.size}",
                                        {"latest": known.checkpoint.size})
                if head.checkpoint.size == old:
                    if not same(head.checkpoint.root, known.checkpoint.root):
                        raise BeaconRefused(422, f"the run signed another root for size {old}")
                    return latest.index
                try:
                    verify_consistency(old, head.checkpoint.size, known.checkpoint.root, head.checkpoint.root, proof)
                except VerificationError as e:
                    raise BeaconRefused(422, f"the head is not consistent with the run's head of size {old}: {e}") \
                        from None
            elif old != 0:
                raise BeaconRefused(409, "the run has no head here yet: old is 0", {"latest": 0})
            return self._add(s, head.entry(), "head", run, None, head.checkpoint.size).index

    def _add(self, s: Session, entry: bytes, kind: str, run: str, seed: str | None, size: int) -> OperatorEntry:
        row = OperatorEntry(index=self.tree.size, entry=entry, kind=kind, run=run, seed=seed, size=size,
                            received_ms=now_ms())
        s.add(row)
        s.commit()
        self.tree.append(entry_leaf(entry))  # (after the write: a crash leaves no leaf the table lacks)
        return row

    # --- checkpoints ----------------------------------------------------------------------
    def cosigned(self, index: int) -> dict:
        """The first cosigned checkpoint that holds entry ``index`` (cosigning one now if none does), with
        the entry's inclusion proof in it."""
        with self._publish:
            cp = self.latest()
            if cp is None or cp.size <= index:
                cp = self._cosign()
        with self._append:  # (the tree is read whole, never mid-append)
            proof = self.tree.inclusion_proof(index, cp.size)
        return {"index": index, "size": cp.size, "checkpoint": cp.note, "inclusion": [h.hex() for h in proof]}

    def latest(self) -> OperatorCheckpoint | None:
        """The latest cosigned checkpoint."""
        with self.sessions() as s:
            return s.scalar(select(OperatorCheckpoint).order_by(OperatorCheckpoint.size.desc()).limit(1))

    def _cosign(self) -> OperatorCheckpoint:
        """Sign a checkpoint of every entry so far and have the witnesses cosign it (``required`` of them)."""
        with self._append:  # a size and its root read together, never mid-append
            size = self.tree.size
            root = self.tree.root(size)
        text = Checkpoint(self.origin, size, root).text()
        note = Note(text, (sign_note(text, self.origin, self.key),)).encode()
        prev = self.latest()
        sigs: list[NoteSignature] = []
        refusals = []
        for i, w in enumerate(self.witnesses):
            try:
                sigs.append(self._ask(i, w, prev.size if prev else 0, size, note))
            except WitnessError as e:
                refusals.append(str(e))
        if len(sigs) < self.required:
            raise BeaconRefused(503, f"{len(sigs)} of the {self.required} witnesses the log needs cosigned its "
                                     f"checkpoint of size {size}: {'; '.join(refusals)[:2000]}")
        cosigned = Note(text, (*parse_note(note).signatures, *sigs)).encode().decode()
        with self.sessions() as s:
            row = OperatorCheckpoint(size=size, root=root.hex(), note=cosigned, made_ms=now_ms())
            s.add(row)
            s.commit()
            s.refresh(row)
            s.expunge(row)
        return row

    def _ask(self, i: int, w: WitnessClient, old: int, size: int, note: bytes) -> NoteSignature:
        """One witness's cosignature, from the size it last cosigned (learned again from its 409)."""
        old = self._seen.get(i, old)
        for _ in range(2):
            with self._append:
                proof = self.tree.consistency_proof(old, size) if 0 < old < size else []
            try:
                sig = w.add_checkpoint(old, proof, note)
                self._seen[i] = size
                return sig
            except WitnessError as e:
                if e.status != 409 or e.latest is None or not 0 <= e.latest <= size or e.latest == old:
                    raise
                old = e.latest  # a witness that saw more of the log than this process knew, or less
        raise WitnessError(f"witness {i + 1} kept naming another size")

    # --- reading --------------------------------------------------------------------------
    def entries(self, start: int, count: int) -> list[str]:
        """Entries from ``start``, as text (see ``read_entries``)."""
        return read_entries(self.sessions, start, count)

    def size(self) -> int:
        """Entries written."""
        with self.sessions() as s:
            return int(s.scalar(select(func.count()).select_from(OperatorEntry)) or 0)

    def consistency(self, old: int, new: int) -> list[str]:
        """A consistency proof between two sizes of the log (hex hashes)."""
        with self._append:
            if not 0 < old <= new <= self.tree.size:
                raise BeaconRefused(400, f"no consistency proof from {old} to {new} in a log of {self.tree.size}")
            return [h.hex() for h in self.tree.consistency_proof(old, new)] if old < new else []


def read_entries(sessions: SessionFactory, start: int, count: int) -> list[str]:
    """An operator log's entries from ``start``, as text: at most ``count`` (and ``ENTRIES_PAGE``), and no
    more than ``PAGE_BYTES`` of them after the first (an answer a client reads within its bound). A
    reader needs no ``OperatorLog`` (a leaderboard's workers read the log its server appends to)."""
    out, size = [], 0
    with sessions() as s:
        for r in s.scalars(select(OperatorEntry.entry).where(
                OperatorEntry.index >= start, OperatorEntry.index < start + min(count, ENTRIES_PAGE))
                .order_by(OperatorEntry.index)):
            size += len(r)
            if out and size > PAGE_BYTES:
                break
            out.append(r.decode("utf-8"))
    return out
