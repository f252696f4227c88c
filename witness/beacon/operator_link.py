"""The trainer's side of an operator's log: each head goes to the operator (``witness operator serve``),
which enters it in its one long-lived log and has that log's checkpoint cosigned by the witnesses it is
configured with; the drand round after it fixes the window, as for a run's own log (``windows``).

The trainer never speaks to a witness: it checks what comes back (the operator's signature, the
witnesses' cosignatures and the head entry's inclusion) so that a window it keeps is one a verifier takes.
"""

from __future__ import annotations

import threading
import time

import httpx

from ..commit.cosignature import cosignature_timestamp, verify_cosignature
from ..commit.log import RunLog
from ..commit.merkle import root_from_inclusion
from ..commit.note import ED25519, Checkpoint, NoteKey, parse_note, verify_note_signature
from ..commit.operator import entry_leaf, head_entry
from ..commit.signing import SignedTreeHead
from ..commit.window import OperatorProof, WitnessedWindow
from ..errors import MalformedInput, VerificationError
from .client import BeaconError, BoundedClient, _detail
from .drand import DrandClient
from .windows import LATENCY_START, PendingWindow, WitnessedLink, _proof


class OperatorError(BeaconError):
    """The operator refused a request, or answered what does not verify (``status``, and for a 409 on a
    head the ``latest`` size the log holds of the run)."""

    def __init__(self, message: str, status: int | None = None, latest: int | None = None):
        super().__init__(message)
        self.status, self.latest = status, latest


class OperatorClient(BoundedClient):
    """The operator log at ``url`` (its routes under ``/api/operator``); ``vkey`` pins its note key."""

    error = OperatorError

    def __init__(self, url_or_client: str | httpx.Client, vkey: str | None = None, *, retries: int = 5,
                 timeout: float = 60.0, patience: float = 600.0, deadline: float = 300.0):
        super().__init__(url_or_client, what="the operator log", empty_url="the operator log's URL is empty",
                         retries=retries, timeout=timeout, patience=patience, deadline=deadline)
        info = self._json("GET", "/key")
        try:
            self.key = NoteKey.parse(info["vkey"])
            self.witnesses = tuple(NoteKey.parse(v) for v in info["witnesses"])
            self.required = int(info["required"])
        except (KeyError, TypeError, ValueError, MalformedInput) as e:
            raise OperatorError(f"{self.where} describes no log ({e})") from None
        if self.key.alg != ED25519 or (vkey is not None and NoteKey.parse(vkey) != self.key):
            raise OperatorError(f"{self.where} signs as {self.key.vkey()[:100]}, not the pinned {str(vkey)[:100]}")

    def _json(self, method: str, path: str, **kw) -> dict:  # noqa: ANN003
        try:
            resp = self._request(method, "/api/operator" + path, **kw)
        except httpx.TransportError as e:
            raise OperatorError(f"{self.where} cannot be reached: {e}") from None
        if resp.status_code != 200:
            latest = None
            if resp.status_code == 409:
                try:
                    evidence = resp.json().get("evidence")
                    latest = evidence.get("latest") if isinstance(evidence, dict) else None
                except (BeaconError, AttributeError):
                    latest = None
            raise OperatorError(f"{self.where} refused {path}: {resp.status_code} {_detail(resp)}", resp.status_code,
                                latest if type(latest) is int else None)
        try:
            out = resp.json()
        except BeaconError as e:
            raise OperatorError(str(e)) from None
        if not isinstance(out, dict):
            raise OperatorError(f"{self.where} answered {path} with no object")
        return out

    def register(self, manifest_line: bytes) -> dict:
        """Enter the run in the log (its manifest: every run of its seed is then readable there)."""
        return self._json("POST", "/runs", json={"manifest": manifest_line.decode("utf-8")})

    def head(self, run: bytes, note: bytes, old: int, proof: list[bytes]) -> dict:
        """Enter a head; the cosigned checkpoint that holds it and its inclusion proof (as sent)."""
        return self._json("POST", "/heads", patient=True, json={
            "run": run.hex(), "checkpoint": note.decode(), "old": old, "proof": [h.hex() for h in proof]})

    def entries(self, start: int) -> list[bytes]:
        """The log's entries from ``start``, a page of them (what a verifier prices attempts from)."""
        answer = self._json("GET", "/entries", params={"start": start})
        got = answer.get("entries")
        if answer.get("start") != start or not isinstance(got, list) or not all(isinstance(e, str) for e in got):
            raise OperatorError(f"{self.where} served no entries from {start}")
        return [e.encode("utf-8") for e in got]

    def consistency(self, old: int, new: int) -> tuple[bytes, ...]:
        """A consistency proof between two sizes of the log."""
        answer = self._json("GET", "/consistency", params={"old": old, "new": new})
        try:
            return tuple(bytes.fromhex(h) for h in answer["proof"])
        except (KeyError, TypeError, ValueError) as e:
            raise OperatorError(f"{self.where} served no consistency proof ({e})") from None


class OperatorLink(WitnessedLink):
    """Heads to an operator's log, randomness from ``drand`` (``witness train --operator URL --drand URL``)."""

    def __init__(self, operator: OperatorClient, drand: DrandClient):  # noqa: D107 - the class says it
        self.operator, self.drand, self.chain = operator, drand, drand.chain
        self.keys = list(operator.witnesses)
        self.witnesses = []  # (the trainer speaks to none of them)
        self.public_key = f"the operator log {operator.key.name}"
        self._key = None
        self._registered = False
        self.sent_size = 0
        self._old = 0  # the run's latest head in the operator's log
        self._last_op: tuple[int, bytes] | None = None  # the last window's operator checkpoint (size, root)
        self.latency = LATENCY_START
        self._lock = threading.Lock()
        self.late_windows = 0
        self._origin = None

    @property
    def request_cpu_seconds(self) -> float:
        """The CPU time of the operator's request threads."""
        return self.operator.request_cpu_seconds

    def resume_at(self, size: int) -> None:
        """A resumed run: its heads are in the log up to ``size`` (the last window it kept)."""
        self.sent_size, self._old, self._registered = size, size, size > 0

    def post(self, body: dict, head: SignedTreeHead, log: RunLog) -> PendingWindow:
        """The head to the operator; checked: its entry in the cosigned checkpoint that came back."""
        from ..commit.beacon import run_id
        from ..commit.drand import round_time

        if not self._registered:
            self.operator.register(body["manifest"])
            self._registered = True
        run = run_id(body["manifest"])
        answer = self.enter(run, body["note"], body["log"], head.size)
        op = self._checked(answer, run, body["note"])
        self._old = head.size
        due = round_time(self.chain, body["round"])
        note = parse_note(op.checkpoint)
        late = [k.name for k in self.keys if not any(cosignature_timestamp(s) + self.chain.period < due
                                                     for s in note.of_key(k))]
        took = time.time() - body["made"]
        with self._lock:
            self.latency = max(took, 0.8 * self.latency + 0.2 * took)
        if len(self.keys) - len(late) < self.operator.required:
            self.late_windows += 1
        return PendingWindow(head.size, body["prev"], body["round"], body["note"], body["final"], late,
                             op.to_json())

    def enter(self, run: bytes, note: bytes, log: RunLog, size: int) -> dict:
        """The head of ``size`` into the log, proved from the run's latest head there (which the operator
        names where this process knew another: a resumed run whose heads went further than it kept)."""
        proof = _proof(log, size, self._old) if self._old else []
        try:
            return self.operator.head(run, note, self._old, proof)
        except OperatorError as e:
            if e.status != 409 or e.latest is None or not 0 <= e.latest < size or e.latest == self._old:
                raise
            self._old = e.latest
            return self.operator.head(run, note, e.latest, _proof(log, size, e.latest) if e.latest else [])

    def _checked(self, answer: dict, run: bytes, note: bytes) -> OperatorProof:
        """The operator's answer as a window's proof, every part of it verified."""
        try:
            op = OperatorProof.from_json({"checkpoint": answer["checkpoint"], "index": answer["index"],
                                          "inclusion": answer["inclusion"], "consistency": []})
            parsed = parse_note(op.checkpoint)
            cp = Checkpoint.parse(parsed.text)
            if cp.origin != self.operator.key.name or not verify_note_signature(parsed, self.operator.key):
                raise VerificationError("the checkpoint is not the operator log's, signed by its key")
            cosigned = sum(1 for k in self.keys if [verify_cosignature(parsed.text, s, k) for s in parsed.of_key(k)])
            if cosigned < self.operator.required:
                raise VerificationError(f"{cosigned} of the {self.operator.required} witnesses cosigned it")
            leaf = entry_leaf(head_entry(run, note).entry())
            if root_from_inclusion(leaf, op.index, cp.size, op.inclusion) != cp.root:
                raise VerificationError("the head's entry is not in the checkpoint")
        except (KeyError, MalformedInput, VerificationError, ValueError) as e:
            raise OperatorError(f"{self.operator.where} answered a head with what does not verify: {e}") from None
        return op

    def settle(self, pending: PendingWindow, log: RunLog) -> WitnessedWindow:
        """Wait for the window's round; the window, with a consistency proof from the window before's
        operator checkpoint."""
        from ..commit.beacon import run_id

        signature, _ = self.drand.fetch(pending.round)
        op = OperatorProof.from_json(pending.operator)
        cp = Checkpoint.parse(parse_note(op.checkpoint).text)
        consistency: tuple[bytes, ...] = ()
        if self._last_op is not None and self._last_op[0] < cp.size:
            consistency = self.operator.consistency(self._last_op[0], cp.size)
        self._last_op = (cp.size, cp.root)
        proof = OperatorProof(op.checkpoint, op.index, op.inclusion, consistency)
        return WitnessedWindow(run_id(log.lines[0]), pending.size, pending.prev_size, pending.round, pending.note,
                               signature, pending.final, (), proof)

    def check(self, obj: object, log: RunLog) -> WitnessedWindow:
        """A kept window of this run (a resume reads them back): the last one's operator checkpoint is
        where the next window's consistency proof starts."""
        from ..commit.beacon import run_id

        try:
            w = WitnessedWindow.from_json(obj)
            if w.run != run_id(log.lines[0]) or w.operator is None:
                raise VerificationError("a kept window of another run, or not through the operator's log")
            self._checked({"checkpoint": w.operator.checkpoint.decode(), "index": w.operator.index,
                           "inclusion": [h.hex() for h in w.operator.inclusion]}, w.run, w.checkpoint)
        except (VerificationError, ValueError, OperatorError) as e:
            raise BeaconError(f"a kept window does not verify: {e}") from None
        cp = Checkpoint.parse(parse_note(w.operator.checkpoint).text)
        if self._last_op is None or cp.size > self._last_op[0]:
            self._last_op = (cp.size, cp.root)
        return w
