"""Witnessed windows that came through an operator's log (``witness.commit.operator``), checked offline.

The witnesses cosigned the operator's checkpoint, not the run's: so each window must show the run's
checkpoint signed by the run's key, its head entry included in an operator checkpoint signed by the
pinned operator key, and each operator checkpoint consistent with the one before it in the bundle. The
run's other attempts are read from the log itself: every run it holds with the run's seed, up to the
final window's cosigned checkpoint, whose root the entries must rebuild.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..commit.merkle import MerkleTree, root_from_inclusion, verify_consistency
from ..commit.note import (
    ED25519,
    Checkpoint,
    Note,
    NoteKey,
    parse_note,
    run_origin,
    verify_note_signature,
)
from ..commit.operator import HeadEntry, RunEntry, entry_leaf, head_entry, parse_entry
from ..commit.window import WitnessedWindow
from ..errors import MalformedInput, VerificationError

MAX_ENTRIES = 1 << 22  # entries a verifier reads to price a run's attempts


@dataclass(frozen=True)
class OperatorTrust:
    """The operator's log the verifier pins (its note key, named by its origin), and where its entries are
    read (``entries(start)``: the entries from ``start`` on, a page; None: the attempts stay unknown)."""

    key: NoteKey
    entries: Callable[[int], list[bytes]] | None = None

    def __post_init__(self) -> None:
        if self.key.alg != ED25519:
            raise MalformedInput("--operator: an operator log's key is an Ed25519 note key (type 0x01)")


class OperatorChain:
    """The operator checkpoints of one bundle's windows, in order: each checked, and consistent with the last."""

    def __init__(self, trust: OperatorTrust, run: bytes, public_key: bytes, extends: Callable[[int, bytes], bool],
                 signed: int):
        """``extends(size, root)``: whether the bundle's log has that root at that size; ``signed``: its size."""
        self.trust, self.run, self.origin = trust, run, run_origin(run)
        self.extends, self.signed = extends, signed
        self.run_key = NoteKey(self.origin, ED25519, public_key)
        self.last: Checkpoint | None = None

    def window(self, w: WitnessedWindow, where: str) -> Note:
        """The operator note whose cosignatures count for ``w`` (checked: the run key's signature on the run's
        checkpoint, the operator's on its own, the head entry's inclusion, consistency with the last)."""
        if w.operator is None:
            raise VerificationError(f"{where} did not come through the pinned operator log {self.trust.key.name}",
                                    check="witness")
        try:
            run_note, op_note = parse_note(w.checkpoint), parse_note(w.operator.checkpoint)
            cp = Checkpoint.parse(op_note.text)
            entry = head_entry(self.run, w.checkpoint).entry()
        except (MalformedInput, ValueError) as e:
            raise MalformedInput(f"{where}: its operator proof: {e}") from None
        if not verify_note_signature(run_note, self.run_key):
            raise VerificationError(f"{where}: its checkpoint is not signed by the run's key", check="witness")
        if cp.origin != self.trust.key.name or cp.extensions or not verify_note_signature(op_note, self.trust.key):
            raise VerificationError(f"{where}: its operator checkpoint is not the pinned log's ({cp.origin[:80]!r}), "
                                    "signed by its key", check="witness")
        try:
            root = root_from_inclusion(entry_leaf(entry), w.operator.index, cp.size, w.operator.inclusion)
        except (ValueError, VerificationError):
            root = None
        if root != cp.root:
            raise VerificationError(f"{where}: its head is not entry {w.operator.index} of the operator checkpoint of "
                                    f"size {cp.size}", check="witness")
        if self.last is not None:
            if cp.size < self.last.size:
                raise VerificationError(f"{where}: its operator checkpoint (size {cp.size}) comes before the last "
                                        f"window's (size {self.last.size})", check="witness")
            verify_consistency(self.last.size, cp.size, self.last.root, cp.root, list(w.operator.consistency)) \
                if cp.size > self.last.size else _same_root(self.last, cp, where)
        self.last = cp
        return op_note

    def attempts(self) -> tuple[int | None, int | None, str | None]:
        """The other runs of this run's seed in the log, up to the last checkpoint: (others, attempts, why
        unknown)."""
        if self.trust.entries is None or self.last is None:
            return None, None, (f"the verifier read no entries of the operator log {self.trust.key.name} (--operator-url)"
                                ": the run's other attempts there are unknown")
        size = self.last.size
        if size > MAX_ENTRIES:
            return None, None, f"the operator log holds {size} entries, over the {MAX_ENTRIES} a verifier reads"
        raw: list[bytes] = []
        while len(raw) < size:
            page = self.trust.entries(len(raw))
            if not page:
                raise VerificationError(f"the operator log served {len(raw)} of the {size} entries its checkpoint "
                                        "holds", check="witness")
            raw += page[:size - len(raw)]
        if MerkleTree([entry_leaf(e) for e in raw]).root() != self.last.root:
            raise VerificationError("the operator log's entries are not the ones its cosigned checkpoint holds",
                                    check="witness")
        parsed = [parse_entry(e) for e in raw]
        # one head of each size for this run: the operator's witnesses see its log, not each run's, so a second
        # version of this run's log entered beside the first (a fork, for a second draw) shows here
        for e in parsed:
            if isinstance(e, HeadEntry) and e.run == self.run and (
                    e.checkpoint.size > self.signed or not self.extends(e.checkpoint.size, e.checkpoint.root)):
                raise VerificationError(f"the operator log holds a head of this run (size {e.checkpoint.size}) that "
                                        "is not this bundle's log: another version of the run, entered beside it",
                                        check="witness")
        runs = [e for e in parsed if isinstance(e, RunEntry)]
        mine = [e for e in runs if e.run == self.run]
        if not mine:
            raise VerificationError("the operator log holds no registration of this run", check="witness")
        seed = mine[0].seed
        others = sum(1 for e in runs if e.run != self.run and seed is not None and e.seed == seed)
        return others, others, None


def _same_root(last: Checkpoint, cp: Checkpoint, where: str) -> None:
    if last.root != cp.root:
        raise VerificationError(f"{where}: two operator checkpoints of size {cp.size} with other roots",
                                check="witness")
