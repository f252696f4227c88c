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

from ..commit.hashing import node_hash
from ..commit.merkle import EMPTY_ROOT, root_from_inclusion, verify_consistency
from ..commit.note import (
    ED25519,
    Checkpoint,
    Note,
    NoteKey,
    parse_note,
    run_origin,
    verify_note_signature,
)
from ..commit.operator import HeadEntry, RunEntry, entry_leaf, head_entry, parse_entry, seed_tag
from ..commit.window import WitnessedWindow
from ..errors import MalformedInput, VerificationError

MAX_ENTRIES = 1 << 22  # entries a verifier reads to price a run's attempts


@dataclass(frozen=True)
class OperatorTrust:
    """The operator's log the verifier pins (its note key, named by its origin), and where its entries are
    read (``entries(start)``: the entries from ``start`` on, a page; None: the attempts stay unknown).
    ``others``: runs (ids) the verifier knows to be attempts at this one whatever their seed (a
    leaderboard's: the account's other runs it did not certify), each counted where the log holds it."""

    key: NoteKey
    entries: Callable[[int], list[bytes]] | None = None
    others: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        if self.key.alg != ED25519:
            raise MalformedInput("--operator: an operator log's key is an Ed25519 note key (type 0x01)")


class OperatorChain:
    """The operator checkpoints of one bundle's windows, in order: each checked, and consistent with the last."""

    def __init__(self, trust: OperatorTrust, run: bytes, public_key: bytes, seed: bytes,
                 extends: Callable[[int, bytes], bool], signed: int):
        """``seed``: the run's seed (its manifest's); ``extends(size, root)``: whether the bundle's log has that
        root at that size; ``signed``: its size."""
        self.trust, self.run, self.origin = trust, run, run_origin(run)
        self.seed, self.tag = seed, seed_tag(seed, run)
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
        unknown). Read as they come (a root built on a stack, each entry kept only as what is counted)."""
        if self.trust.entries is None or self.last is None:
            return None, None, (f"the verifier read no entries of the operator log {self.trust.key.name} (--operator-url)"
                                ": the run's other attempts there are unknown")
        size = self.last.size
        if size > MAX_ENTRIES:
            return None, None, f"the operator log holds {size} entries, over the {MAX_ENTRIES} a verifier reads"
        root, index, registered, first_head, others = _StreamingRoot(), 0, None, None, 0
        while index < size:
            page = self.trust.entries(index)
            if not page:
                raise VerificationError(f"the operator log served {index} of the {size} entries its checkpoint "
                                        "holds", check="witness")
            for raw in page[:size - index]:
                root.add(entry_leaf(raw))
                e = parse_entry(raw)
                if isinstance(e, HeadEntry) and e.run == self.run:
                    # one head of each size for this run: the operator's witnesses see its log, not each run's, so a
                    # second version of this run's log entered beside the first (a fork, for a second draw) shows here
                    if e.checkpoint.size > self.signed or not self.extends(e.checkpoint.size, e.checkpoint.root):
                        raise VerificationError(f"the operator log holds a head of this run (size "
                                                f"{e.checkpoint.size}) that is not this bundle's log: another version "
                                                "of the run, entered beside it", check="witness")
                    first_head = index if first_head is None else first_head
                elif isinstance(e, RunEntry) and e.run == self.run:
                    registered = index if registered is None else registered
                    if e.seed_tag != self.tag or e.public_key != self.run_key.public:
                        raise VerificationError("the operator log's registration of this run is not its seed tag and "
                                                "key", check="witness")
                elif isinstance(e, RunEntry) and (e.run in self.trust.others or (
                        e.seed_tag is not None and e.seed_tag == seed_tag(self.seed, e.run))):
                    others += 1  # another run of this seed (or named): an attempt, whatever its key, recipe or fate
                index += 1
        if root.root() != self.last.root:
            raise VerificationError("the operator log's entries are not the ones its cosigned checkpoint holds",
                                    check="witness")
        # registered before any of its heads: a run drew no window before it was counted among its seed's
        if registered is None or (first_head is not None and registered > first_head):
            raise VerificationError("the operator log holds no registration of this run before its first head",
                                    check="witness")
        return others, others, None


class _StreamingRoot:
    """An RFC 6962 root of leaves given one at a time, on a stack of complete subtrees (O(log n) memory)."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, bytes]] = []  # (leaves, root) of complete subtrees, largest first

    def add(self, leaf: bytes) -> None:
        """Append a leaf hash."""
        node = (1, leaf)
        while self.stack and self.stack[-1][0] == node[0]:
            left = self.stack.pop()
            node = (left[0] * 2, node_hash(left[1], node[1]))
        self.stack.append(node)

    def root(self) -> bytes:
        """The root of the leaves so far (the empty tree's for none)."""
        if not self.stack:
            return EMPTY_ROOT
        acc = self.stack[-1][1]
        for _, h in reversed(self.stack[:-1]):  # the smaller subtrees sit right of the larger ones
            acc = node_hash(h, acc)
        return acc


def _same_root(last: Checkpoint, cp: Checkpoint, where: str) -> None:
    if last.root != cp.root:
        raise VerificationError(f"{where}: two operator checkpoints of size {cp.size} with other roots",
                                check="witness")
