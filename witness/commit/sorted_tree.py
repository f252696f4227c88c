"""A Merkle tree over sorted, distinct hashes, with O(log n) proofs of membership and absence.

Each leaf holds a pair of *adjacent* values: for sorted distinct values ``v_0 < … < v_{n-1}``,
leaf ``i`` (``0 <= i <= n``) is ``(v_{i-1}, v_i)``, where the first leaf has no lower value and
the last no upper one. Membership of ``x`` is the leaf whose upper value is ``x``; absence of
``x`` is the one leaf whose two values bracket ``x``. Either way a proof is one leaf and one
RFC 6962 audit path: the two bracketing values can never be shown "adjacent" unless they are,
since adjacency is committed inside the leaf. (An empty set is one leaf with neither value.)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import VerificationError
from .hashing import HASH_SIZE, leaf_hash
from .merkle import MerkleTree, verify_inclusion


def pair_leaf(lower: bytes | None, upper: bytes | None) -> bytes:
    """Leaf hash of a pair of adjacent values (a flag byte says which ends exist)."""
    flags = (1 if lower is not None else 0) | (2 if upper is not None else 0)
    return leaf_hash(bytes([flags]) + (lower or b"") + (upper or b""))


@dataclass(frozen=True)
class PairProof:
    """Leaf ``index`` of a tree of ``size`` values holds ``(lower, upper)``; ``path`` leads to the root."""

    index: int
    lower: bytes | None
    upper: bytes | None
    size: int
    path: list[bytes]


class SortedTree:
    """Distinct 32-byte values, sorted, committed as a tree of adjacent pairs."""

    def __init__(self, values: Iterable[bytes]):
        self.values = sorted(set(values))
        for v in self.values:
            if len(v) != HASH_SIZE:
                raise ValueError("sorted-tree values are 32-byte hashes")
        bounds: list[bytes | None] = [None, *self.values, None]
        self.tree = MerkleTree([pair_leaf(bounds[i], bounds[i + 1]) for i in range(len(self.values) + 1)])

    @property
    def size(self) -> int:
        """Number of distinct values (the tree has one more leaf)."""
        return len(self.values)

    @property
    def root(self) -> bytes:
        """The commitment."""
        return self.tree.root()

    def __contains__(self, value: bytes) -> bool:
        i = bisect.bisect_left(self.values, value)
        return i < self.size and self.values[i] == value

    def _proof(self, i: int) -> PairProof:
        lower = self.values[i - 1] if i > 0 else None
        upper = self.values[i] if i < self.size else None
        return PairProof(i, lower, upper, self.size, self.tree.inclusion_proof(i))

    def prove_member(self, value: bytes) -> PairProof:
        """The leaf whose upper value is ``value``; ValueError if it is absent."""
        if value not in self:
            raise ValueError("not a member")
        return self._proof(bisect.bisect_left(self.values, value))

    def prove_absent(self, value: bytes) -> PairProof:
        """The leaf whose values bracket ``value``; ValueError if it is a member."""
        if value in self:
            raise ValueError("is a member")
        return self._proof(bisect.bisect_left(self.values, value))


def _check(proof: PairProof, root: bytes, size: int) -> None:
    # The size must come from the commitment: "the first" or "the last" leaf means nothing
    # without the true size.
    if proof.size != size:
        raise VerificationError(f"the proof is for a tree of {proof.size} values; the commitment has {size}")
    if not 0 <= proof.index <= size:
        raise VerificationError(f"leaf {proof.index} is outside a tree of {size} values")
    if (proof.lower is None) != (proof.index == 0) or (proof.upper is None) != (proof.index == size):
        raise VerificationError("only the first leaf lacks a lower value and only the last an upper one")
    for v in (proof.lower, proof.upper):
        if v is not None and len(v) != HASH_SIZE:
            raise VerificationError("a bracketing value is not a 32-byte hash")
    if proof.lower is not None and proof.upper is not None and not proof.lower < proof.upper:
        raise VerificationError("the leaf's values are not in sorted order")
    verify_inclusion(pair_leaf(proof.lower, proof.upper), proof.index, size + 1, proof.path, root)


def verify_member(value: bytes, proof: PairProof, root: bytes, size: int) -> None:
    """Raise unless ``value`` is in the committed sorted tree (``root`` over ``size`` values)."""
    _check(proof, root, size)
    if proof.upper != value:
        raise VerificationError("the leaf does not hold the value")


def verify_absent(value: bytes, proof: PairProof, root: bytes, size: int) -> None:
    """Raise unless the committed sorted tree (``root`` over ``size`` values) does not hold ``value``."""
    if len(value) != HASH_SIZE:
        raise VerificationError("the query is not a 32-byte hash")
    _check(proof, root, size)
    if not ((proof.lower is None or proof.lower < value) and (proof.upper is None or value < proof.upper)):
        raise VerificationError("the query does not lie strictly between the leaf's adjacent values")
