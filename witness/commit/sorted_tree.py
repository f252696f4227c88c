"""A Merkle tree over sorted, distinct hashes: O(log n) proofs of membership and of absence.

Membership is an inclusion proof. Absence is a *range proof* for two adjacent leaves that
bracket the query (or for the first or last leaf alone when the query lies outside the
range); a range proof carries the hashes of the subtrees outside the range, in the order the
RFC 6962 recursion meets them, and the checker recomputes the root from the range's leaves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import VerificationError
from .hashing import HASH_SIZE, leaf_hash, node_hash, same
from .merkle import EMPTY_ROOT, MerkleTree, _split


def range_proof(tree: MerkleTree, lo: int, hi: int) -> list[bytes]:
    """Hashes of the subtrees outside leaves ``[lo, hi)``, in recursion order."""
    n = tree.size
    if not 0 <= lo < hi <= n:
        raise ValueError(f"no range [{lo}, {hi}) in a tree of {n} leaves")
    out: list[bytes] = []

    def walk(a: int, b: int) -> None:
        if b <= lo or a >= hi:
            out.append(tree._range(a, b))
        elif not (lo <= a and b <= hi):
            k = _split(b - a)
            walk(a, a + k)
            walk(a + k, b)

    walk(0, n)
    return out


def root_from_range(leaves: Sequence[bytes], lo: int, size: int, proof: Sequence[bytes]) -> bytes:
    """Recompute the root of a ``size``-leaf tree from leaf hashes at ``lo..`` and a range proof."""
    hi = lo + len(leaves)
    if not leaves or not 0 <= lo < hi <= size:
        raise VerificationError(f"range [{lo}, {hi}) does not fit a tree of {size} leaves")
    for h in (*leaves, *proof):
        if not isinstance(h, bytes) or len(h) != HASH_SIZE:
            raise VerificationError("range proof holds a node that is not a 32-byte hash")
    nodes = iter(proof)

    def build(a: int, b: int) -> bytes:
        if b <= lo or a >= hi:
            node = next(nodes, None)
            if node is None:
                raise VerificationError("range proof is too short")
            return node
        if b - a == 1:
            return leaves[a - lo]
        k = _split(b - a)
        return node_hash(build(a, a + k), build(a + k, b))

    root = build(0, size)
    if next(nodes, None) is not None:
        raise VerificationError("range proof is too long")
    return root


@dataclass(frozen=True)
class Membership:
    """``value`` is leaf ``index`` of the sorted tree of ``size`` leaves."""

    value: bytes
    index: int
    size: int
    path: list[bytes]


@dataclass(frozen=True)
class Absence:
    """Leaves ``lo`` (and ``lo + 1``) bracket a value the sorted tree does not hold."""

    lo: int
    neighbours: list[bytes]
    size: int
    path: list[bytes]


class SortedTree:
    """Distinct 32-byte values, sorted; leaf ``i`` is ``leaf_hash(values[i])``."""

    def __init__(self, values: Iterable[bytes]):
        self.values = sorted(set(values))
        for v in self.values:
            if len(v) != HASH_SIZE:
                raise ValueError("sorted-tree values are 32-byte hashes")
        self.tree = MerkleTree([leaf_hash(v) for v in self.values])

    @property
    def size(self) -> int:
        """Number of distinct values."""
        return len(self.values)

    @property
    def root(self) -> bytes:
        """The commitment."""
        return self.tree.root()

    def _position(self, value: bytes) -> int:
        import bisect

        return bisect.bisect_left(self.values, value)

    def __contains__(self, value: bytes) -> bool:
        i = self._position(value)
        return i < self.size and self.values[i] == value

    def prove_member(self, value: bytes) -> Membership:
        """Inclusion proof for a member; ValueError if it is absent."""
        i = self._position(value)
        if i >= self.size or self.values[i] != value:
            raise ValueError("not a member")
        return Membership(value, i, self.size, self.tree.inclusion_proof(i))

    def prove_absent(self, value: bytes) -> Absence:
        """Non-membership proof; ValueError if it is a member."""
        if value in self:
            raise ValueError("is a member")
        n = self.size
        if n == 0:
            return Absence(0, [], 0, [])
        i = self._position(value)
        lo, hi = (0, 1) if i == 0 else (n - 1, n) if i == n else (i - 1, i + 1)
        return Absence(lo, self.values[lo:hi], n, range_proof(self.tree, lo, hi))


def verify_member(proof: Membership, root: bytes, size: int) -> None:
    """Raise unless ``proof.value`` is in the committed sorted tree (``root`` over ``size`` leaves)."""
    from .merkle import verify_inclusion

    if proof.size != size:
        raise VerificationError(f"the proof is for a tree of {proof.size} leaves; the commitment has {size}")
    verify_inclusion(leaf_hash(proof.value), proof.index, proof.size, proof.path, root)


def verify_absent(value: bytes, proof: Absence, root: bytes, size: int) -> None:
    """Raise unless the proof shows ``value`` is not in the committed sorted tree (``root``, ``size``).

    The size must come from the commitment: a range proof far from the right edge reaches the
    same root for several sizes, and "the last leaf" only means something for the true size.
    """
    if proof.size != size:
        raise VerificationError(f"the proof is for a tree of {proof.size} leaves; the commitment has {size}")
    n, lo, nb = proof.size, proof.lo, proof.neighbours
    if n == 0:
        if nb or proof.path or not same(root, EMPTY_ROOT):
            raise VerificationError("the tree is not empty")
        return
    if len(value) != HASH_SIZE:
        raise VerificationError("the query is not a 32-byte hash")
    if n == 1:
        if len(nb) != 1 or lo != 0:
            raise VerificationError("a one-leaf tree is bracketed by its only leaf")
    elif len(nb) == 1:
        if lo not in (0, n - 1):
            raise VerificationError("a single bracketing leaf must be the first or the last")
    elif len(nb) != 2 or not 0 <= lo < n - 1:
        raise VerificationError("absence needs two adjacent leaves")
    if len(nb) == 2 and not nb[0] < nb[1]:
        raise VerificationError("the bracketing leaves are not in sorted order")
    got = root_from_range([leaf_hash(v) for v in nb], lo, n, proof.path)
    if not same(got, root):
        raise VerificationError("the bracketing leaves are not adjacent leaves of the committed tree")
    if len(nb) == 2:
        ok = nb[0] < value < nb[1]
    elif n == 1:
        ok = value != nb[0]
    elif lo == 0:
        ok = value < nb[0]
    else:  # lo == n - 1
        ok = value > nb[0]
    if not ok:
        raise VerificationError("the query does not lie outside or between the bracketing leaves")
