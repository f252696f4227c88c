"""Online challenges that trust no single server: a window's randomness from drand, its uniqueness
from transparency-log witnesses.

Each head the recorder streams is a C2SP checkpoint of the run's log (origin ``witness.run/<run id>``),
signed by the run's key in a signed note and cosigned (``cosignature/v1``) by witnesses that keep
the latest checkpoint of each origin and refuse any that does not extend it. The log's record that
a head closes names a drand round R: the root binds it, so every checkpoint of a size has one R,
however often a witness cosigns it again. A window counts when K witnesses the verifier names
cosigned its checkpoint more than one drand period before round R's time: the checkpoint, and so
R, was fixed before anyone could know R's randomness. Its beta is

    beta = SHA-256("witness drand beta v1" 0x00 || checkpoint text || SHA-256(drand signature of R))

The checkpoint's text, not its signature lines: which cosignatures a bundle shows must not change
beta (a trainer with more witnesses than the verifier needs would otherwise choose among draws).

Window boundaries are the manifest's, not the trainer's: a head every ``every`` steps, at every
checkpoint and at the end (``head_sizes``), so a trainer cannot move a boundary to redraw a window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MalformedInput
from .beacon import MAX_INT, window
from .hashing import from_hex, sha256

WINDOW_FORMAT = "witness-window"
WINDOW_VERSION = 1
BETA_DOMAIN = b"witness drand beta v1\x00"
MAX_NOTE_BYTES = 1 << 16  # a checkpoint and a few dozen signature lines
MAX_ATTEMPT_NOTES = 16
MAX_PROOF_HASHES = 64  # an inclusion or consistency proof in a log of fewer than 2^63 entries
_FIELDS = {"format", "version", "run", "size", "prev_size", "round", "checkpoint", "drand_signature", "final"}


def head_sizes(every: int, checkpoint_every: int, steps_planned: int, steps: int, complete: bool) -> list[int]:
    """The sizes of the heads a run streams, in order, over its first ``steps`` steps: after each
    ``every`` steps and each checkpoint (record t + 1 is step t's, so the head after step t has size
    t + 2), and the final head over the end record."""
    # a checkpoint falls every ``checkpoint_every`` updates and after the recipe's last step
    out = [t + 2 for t in range(steps)
           if (t + 1) % every == 0 or (t + 1) % checkpoint_every == 0 or t + 1 == steps_planned]
    if complete:
        out.append(steps + 2)
    return out


def beta_of(checkpoint_text: str, randomness: bytes) -> bytes:
    """A window's beta: its checkpoint's text and its drand round's randomness."""
    return sha256(BETA_DOMAIN + checkpoint_text.encode() + randomness)


@dataclass(frozen=True)
class OperatorProof:
    """How a window's head reached the witnesses through an operator's log (``witness.commit.operator``):
    the log's checkpoint they cosigned, the head entry's index and inclusion proof in it, and a
    consistency proof from the operator checkpoint of the window before (empty for the first window)."""

    checkpoint: bytes  # the operator log's checkpoint note: its signature and the witnesses'
    index: int
    inclusion: tuple[bytes, ...]
    consistency: tuple[bytes, ...] = ()

    def to_json(self) -> dict:
        """JSON form (a window's ``operator`` field)."""
        return {"checkpoint": self.checkpoint.decode(), "index": self.index,
                "inclusion": [h.hex() for h in self.inclusion], "consistency": [h.hex() for h in self.consistency]}

    @classmethod
    def from_json(cls, obj: object) -> OperatorProof:
        """Strictly parse the JSON form."""
        if not isinstance(obj, dict) or set(obj) != {"checkpoint", "index", "inclusion", "consistency"}:
            raise MalformedInput("a window's operator proof has exactly checkpoint, index, inclusion and consistency")
        note, index = obj["checkpoint"], obj["index"]
        if not isinstance(note, str) or len(note.encode("utf-8", "surrogatepass")) > MAX_NOTE_BYTES:
            raise MalformedInput(f"a window's operator checkpoint is a signed note of at most {MAX_NOTE_BYTES} bytes")
        if type(index) is not int or not 0 <= index < MAX_INT:
            raise MalformedInput("a window's operator entry index is a non-negative integer")
        proofs = []
        for f in ("inclusion", "consistency"):
            if not isinstance(obj[f], list) or len(obj[f]) > MAX_PROOF_HASHES:
                raise MalformedInput(f"a window's operator {f} proof is a list of at most {MAX_PROOF_HASHES} hashes")
            try:
                proofs.append(tuple(from_hex(h, f"operator {f} hash") for h in obj[f]))
            except ValueError as e:
                raise MalformedInput(f"a window's operator proof: {e}") from None
        return cls(note.encode(), index, proofs[0], proofs[1])


@dataclass(frozen=True)
class WitnessedWindow:
    """One window as the trainer keeps it: the cosigned checkpoint note, its drand round and that
    round's signature, and (final window) the witnesses' signed counts of the run's other attempts."""

    run: bytes
    size: int
    prev_size: int
    round: int
    checkpoint: bytes  # the signed note: the checkpoint, the run key's signature, the cosignatures
    drand_signature: bytes
    final: bool
    attempts: tuple[bytes, ...] = ()  # signed notes ``witness attempts/v1`` (final window only)
    operator: OperatorProof | None = None  # a head sent through an operator's log: the witnesses cosigned that

    @property
    def checkpoint_text(self) -> str:
        """The checkpoint's text (the note's body)."""
        from .note import parse_note

        return parse_note(self.checkpoint, MAX_NOTE_BYTES).text

    @property
    def randomness(self) -> bytes:
        """drand's randomness of the round: SHA-256 of its signature (checked by the verifier)."""
        return sha256(self.drand_signature)

    @property
    def beta(self) -> bytes:
        """The window's beta."""
        return beta_of(self.checkpoint_text, self.randomness)

    def window(self, steps: int) -> range:
        """The steps this window covers, among a run's first ``steps``."""
        return window(self.prev_size, self.size, steps)

    def to_json(self) -> dict:
        """JSON form (a line of ``online/statements.jsonl``)."""
        out = {"format": WINDOW_FORMAT, "version": WINDOW_VERSION, "run": self.run.hex(), "size": self.size,
               "prev_size": self.prev_size, "round": self.round, "checkpoint": self.checkpoint.decode(),
               "drand_signature": self.drand_signature.hex(), "final": self.final}
        if self.attempts:
            out["attempts"] = [a.decode() for a in self.attempts]
        if self.operator is not None:
            out["operator"] = self.operator.to_json()
        return out

    @classmethod
    def from_json(cls, obj: object) -> WitnessedWindow:
        """Strictly parse the JSON form (signatures not checked)."""
        if not isinstance(obj, dict) or obj.get("format") != WINDOW_FORMAT or obj.get("version") != WINDOW_VERSION \
                or type(obj.get("version")) is not int:
            raise MalformedInput("not a witnessed window of a supported version")
        if not _FIELDS <= set(obj) <= _FIELDS | {"attempts", "operator"}:
            raise MalformedInput("a witnessed window has exactly the fields " + ", ".join(sorted(_FIELDS))
                                 + " (and, on the final one, attempts; through an operator's log, operator)")
        for f in ("size", "prev_size", "round"):
            if type(obj[f]) is not int or not 0 <= obj[f] < MAX_INT:
                raise MalformedInput(f"witnessed window: {f} must be a non-negative integer")
        if not obj["prev_size"] < obj["size"] or obj["round"] < 1:
            raise MalformedInput("witnessed window: its window is empty or its round is not a drand round")
        if type(obj["final"]) is not bool:
            raise MalformedInput("witnessed window: final must be true or false")
        note = obj["checkpoint"]
        if not isinstance(note, str) or len(note.encode("utf-8", "surrogatepass")) > MAX_NOTE_BYTES:
            raise MalformedInput(f"witnessed window: checkpoint must be a signed note of at most {MAX_NOTE_BYTES} bytes")
        attempts = obj.get("attempts", [])
        if not isinstance(attempts, list) or len(attempts) > MAX_ATTEMPT_NOTES or not obj["final"] and attempts \
                or not all(isinstance(a, str) and len(a) <= MAX_NOTE_BYTES for a in attempts):
            raise MalformedInput(f"witnessed window: attempts are at most {MAX_ATTEMPT_NOTES} signed notes, on the "
                                 "final window only")
        try:
            sig = bytes.fromhex(obj["drand_signature"]) if isinstance(obj["drand_signature"], str) else None
            if sig is None or not 1 <= len(sig) <= 256:
                raise ValueError("drand_signature must be hex")
            operator = OperatorProof.from_json(obj["operator"]) if "operator" in obj else None
            return cls(from_hex(obj["run"], "run"), obj["size"], obj["prev_size"], obj["round"],
                       note.encode(), sig, obj["final"], tuple(a.encode() for a in attempts), operator)
        except (ValueError, UnicodeError) as e:
            raise MalformedInput(f"witnessed window: {e}") from None


def parse_statement(obj: object):  # noqa: ANN201 - a BeaconStatement or a WitnessedWindow
    """A line of ``online/statements.jsonl``: a beacon's statement or a witnessed window."""
    from .beacon import BeaconStatement

    if isinstance(obj, dict) and obj.get("format") == WINDOW_FORMAT:
        return WitnessedWindow.from_json(obj)
    return BeaconStatement.from_json(obj)
