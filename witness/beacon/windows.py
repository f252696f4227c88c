"""The trainer's side of witnessed windows: each head as a C2SP checkpoint to every witness, then the
drand round its log names.

Two stages, so that waiting for a round never delays a checkpoint: the recorder's sending thread
calls ``post`` (the checkpoint to each witness, in order: a cosignature must come well before the
round's time) and a second thread calls ``settle`` (wait for the round, fetch and check it). The
round is chosen on the training thread, when the record that closes the window is written
(``next_round``): far enough ahead that the witnesses' cosignatures come more than a period before
it, from the latency seen so far.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..commit.beacon import run_id
from ..commit.cosignature import cosignature_timestamp, verify_cosignature
from ..commit.drand import round_after, round_time
from ..commit.hashing import parse_canonical_json
from ..commit.log import RunLog
from ..commit.note import Checkpoint, Note, NoteKey, parse_note, run_origin, sign_note
from ..commit.signing import SignedTreeHead
from ..commit.window import WitnessedWindow
from ..errors import VerificationError
from .client import BeaconError
from .drand import DrandClient
from .witness_client import WitnessClient, WitnessError

LATENCY_START = 0.5  # seconds: the first checkpoints' guess of how long the witnesses take to cosign
LATENCY_MARGIN = 1.0  # a cosignature's time is in whole seconds (rounded down): one more second


@dataclass(frozen=True)
class PendingWindow:
    """A window whose checkpoint the witnesses cosigned, waiting for its round."""

    size: int
    prev_size: int
    round: int
    note: bytes
    final: bool
    late: list[str]  # witnesses whose cosignature came within a period of the round (it will not count)
    operator: dict | None = None  # through an operator's log: its proof's JSON (``OperatorProof``)

    def to_json(self) -> dict:
        """A line of the run's journal of cosigned checkpoints (``online/cosigned.jsonl``)."""
        out = {"size": self.size, "prev_size": self.prev_size, "round": self.round, "note": self.note.decode(),
               "final": self.final, "late": self.late}
        return out | ({"operator": self.operator} if self.operator is not None else {})

    @classmethod
    def from_json(cls, obj: object) -> PendingWindow:
        """A journal line (the trainer's own file, parsed strictly all the same)."""
        fields = {"size", "prev_size", "round", "note", "final", "late"}
        if not isinstance(obj, dict) or not fields <= set(obj) <= fields | {"operator"} \
                or not all(type(obj[k]) is int for k in ("size", "prev_size", "round")) \
                or not isinstance(obj["note"], str) or type(obj["final"]) is not bool \
                or not isinstance(obj["late"], list):
            raise ValueError("not a cosigned checkpoint of the journal")
        operator = obj.get("operator")
        if operator is not None and not isinstance(operator, dict):
            raise ValueError("not a cosigned checkpoint of the journal")
        return cls(obj["size"], obj["prev_size"], obj["round"], obj["note"].encode(), obj["final"],
                   [str(x) for x in obj["late"]], operator)


class WitnessedLink:
    """Checkpoints to ``witnesses``, randomness from ``drand`` (what ``witness train --witness URL …
    --drand URL`` builds). The recorder hands it the run's key (``use_key``): checkpoints are signed
    notes of the run's key, which the witnesses know from the manifest registered first."""

    def __init__(self, witnesses: list[WitnessClient], drand: DrandClient):
        if not witnesses:
            raise ValueError("witnessed online challenges need at least one witness (--witness URL)")
        self.witnesses, self.drand, self.chain = witnesses, drand, drand.chain
        self.keys: list[NoteKey] = [w.key for w in witnesses]
        self.public_key = ", ".join(k.name for k in self.keys)  # who answers, for messages
        self._key: Ed25519PrivateKey | None = None
        self._registered = False
        self._old = [0] * len(witnesses)  # the size each witness cosigned last
        self.sent_size = 0
        self.latency = LATENCY_START
        self._lock = threading.Lock()
        self.late_windows = 0
        self._origin: tuple[bytes, str] | None = None  # (manifest line, its origin): hashed once a run

    @property
    def request_cpu_seconds(self) -> float:
        """The CPU time of the witnesses' request threads so far (what sending costs the trainer, besides
        the sending thread's own)."""
        return sum(w.request_cpu_seconds for w in self.witnesses)

    def resume_at(self, size: int) -> None:
        """A resumed run: the witnesses cosigned up to the head of ``size`` (the last window it kept), so
        the next checkpoint is proved from there (a witness that is one further says so, and is asked
        again for what it holds)."""
        self.sent_size = size
        self._old = [size] * len(self.witnesses)
        self._registered = size > 0

    def use_key(self, key: Ed25519PrivateKey) -> None:
        """The run's signing key (checkpoints are notes it signs)."""
        self._key = key

    # --- the training thread --------------------------------------------------------------
    def next_round(self) -> int:
        """The round the record closing a window names: the first whose time is later than now plus
        a period plus the time the witnesses have taken to cosign (with a second's margin)."""
        with self._lock:
            lead = self.chain.period + LATENCY_MARGIN + 2 * self.latency
        return round_after(self.chain, time.time() + lead)

    def body(self, head: SignedTreeHead, log: RunLog) -> dict:
        """The checkpoint of ``head``, signed, and the consistency proof from the head sent before it
        (built here, while the log is not being appended to)."""
        if self._key is None:
            raise RuntimeError("the witnessed link has no run key (Recorder hands it one)")
        origin = self.origin(log)
        text = Checkpoint(origin, head.size, head.root).text()
        closing = parse_canonical_json(log.lines[head.size - 1])
        if "round" not in closing:
            raise RuntimeError(f"the record closing the head of size {head.size} names no drand round")
        prev = self.sent_size
        proof = log.tree.consistency_proof(prev, head.size) if 0 < prev < head.size else []
        self.sent_size = max(self.sent_size, head.size)
        note = Note(text, (sign_note(text, origin, self._key),)).encode()
        final = head.extensions is not None and "final_state_hash" in head.extensions
        return {"manifest": log.lines[0], "origin": origin, "text": text, "note": note, "prev": prev, "proof": proof,
                "round": closing["round"], "final": final, "made": time.time(), "log": log, "size": head.size}

    def origin(self, log: RunLog) -> str:
        """The run's log origin (from its manifest line, hashed once)."""
        manifest = log.lines[0]
        if self._origin is None or self._origin[0] is not manifest:
            self._origin = (manifest, run_origin(run_id(manifest)))
        return self._origin[1]

    # --- the sending thread -----------------------------------------------------------------
    def post(self, body: dict, head: SignedTreeHead, log: RunLog) -> PendingWindow:
        """The checkpoint to every witness, in order; the note with their cosignatures."""
        if not self._registered:
            for w in self.witnesses:
                w.register(body["manifest"])
            self._registered = True
        sigs, late = [], []
        due = round_time(self.chain, body["round"])
        for i, w in enumerate(self.witnesses):
            sig = self._cosign(i, w, body)
            ts = cosignature_timestamp(sig)  # the client checked the cosignature, and its timestamp's range
            if not ts + self.chain.period < due:
                late.append(self.keys[i].name)
            sigs.append(sig)
        took = time.time() - body["made"]
        with self._lock:  # the next rounds are chosen further ahead when the witnesses are slow
            self.latency = max(took, 0.8 * self.latency + 0.2 * took)
        if late:
            self.late_windows += 1
            print(f"witness: the head of size {head.size} was cosigned by {', '.join(late)} within a drand period "
                  f"of its round {body['round']}: that window will not count (the next rounds are chosen further "
                  "ahead)", file=sys.stderr)
        note = parse_note(body["note"])
        signed = Note(note.text, (*note.signatures, *sigs)).encode()
        return PendingWindow(head.size, body["prev"], body["round"], signed, body["final"], late)

    def _cosign(self, i: int, w: WitnessClient, body: dict):  # noqa: ANN202 - a NoteSignature
        """One witness's cosignature: from the size it cosigned last (it says which when another)."""
        old, proof, size = body["prev"], body["proof"], body["size"]
        if self._old[i] != old:  # this witness is behind or ahead of the others (a resumed run)
            old, proof = self._old[i], _proof(body["log"], size, self._old[i])
        try:
            sig = w.add_checkpoint(old, proof, body["note"])
        except WitnessError as e:
            latest = getattr(e, "latest", None)
            if latest is None or latest == old or latest > size:
                raise BeaconError(str(e)) from None
            sig = w.add_checkpoint(latest, _proof(body["log"], size, latest), body["note"])  # what it holds
        self._old[i] = size
        return sig

    # --- the settling thread ----------------------------------------------------------------
    def settle(self, pending: PendingWindow, log: RunLog) -> WitnessedWindow:
        """Wait for the window's round; the window, its drand signature checked."""
        signature, _ = self.drand.fetch(pending.round)
        attempts: tuple[bytes, ...] = ()
        if pending.final:
            origin = run_origin(run_id(log.lines[0]))
            attempts = tuple(w.attempts(origin)[2] for w in self.witnesses)
        return WitnessedWindow(run_id(log.lines[0]), pending.size, pending.prev_size, pending.round, pending.note,
                               signature, pending.final, attempts)

    # --- a resumed run ----------------------------------------------------------------------
    def statements(self, log: RunLog) -> list[WitnessedWindow]:
        """Nothing to fetch: the witnesses keep only the latest checkpoint, the bundle keeps the windows."""
        return []

    def check(self, obj: object, log: RunLog) -> WitnessedWindow:
        """A kept window of this run, with this link's witnesses' cosignatures (a resume reads them back)."""
        try:
            w = WitnessedWindow.from_json(obj)
            if w.run != run_id(log.lines[0]):
                raise VerificationError("a kept window names another run")
            note = parse_note(w.checkpoint)
            for key in self.keys:
                mine = note.of_key(key)
                if not mine:
                    raise VerificationError(f"a kept window lacks {key.name}'s cosignature")
                for s in mine:
                    verify_cosignature(note.text, s, key)
        except (VerificationError, ValueError) as e:
            raise BeaconError(f"a kept window does not verify: {e}") from None
        return w


def _proof(log: RunLog, size: int, old: int) -> list[bytes]:
    """A consistency proof from ``old`` to the first ``size`` lines of ``log``, rarely needed (a witness
    behind or ahead of the others): built from a copy of those lines, never from the tree the
    training thread appends to (its first ``size`` lines do not change; the list is only appended to)."""
    if not 0 < old < size:
        return []
    return RunLog(log.lines[:size]).tree.consistency_proof(old, size)
