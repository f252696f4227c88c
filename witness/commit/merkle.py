"""RFC 6962 / RFC 9162 Merkle trees: roots, inclusion and consistency proofs.

The tree keeps every level so that a proof costs O(log n) hashes of stored nodes.
Verification follows RFC 9162 §2.1.3.2 and §2.1.4.2 and raises on any mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import VerificationError
from .hashing import HASH_SIZE, node_hash, same, sha256

EMPTY_ROOT = sha256(b"")


def _split(n: int) -> int:
    """The largest power of two strictly below ``n`` (n >= 2): RFC 6962's split point."""
    return 1 << ((n - 1).bit_length() - 1)


class MerkleTree:
    """A Merkle tree over leaf hashes (already domain-separated with 0x00)."""

    def __init__(self, leaf_hashes: Sequence[bytes] = ()):
        self.levels: list[list[bytes]] = [list(leaf_hashes)]
        self._rebuild()

    def _rebuild(self) -> None:
        level = self.levels[0]
        self.levels = [level]
        while len(level) > 1:
            nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                nxt.append(level[-1])  # an unpaired node is promoted unchanged (RFC 6962 MTH)
            self.levels.append(nxt)
            level = nxt

    def append(self, leaf: bytes) -> None:
        """Append one leaf hash, updating only the right edge of each level."""
        self.levels[0].append(leaf)
        i, lvl = len(self.levels[0]) - 1, 0
        while True:
            level = self.levels[lvl]
            if len(level) == 1:
                del self.levels[lvl + 1 :]
                return
            if lvl + 1 == len(self.levels):
                self.levels.append([])
            parent = i >> 1
            up = self.levels[lvl + 1]
            value = node_hash(level[i - 1], level[i]) if i % 2 else level[i]
            if parent < len(up):
                up[parent] = value
            else:
                up.append(value)
            i, lvl = parent, lvl + 1

    @property
    def size(self) -> int:
        """Number of leaves."""
        return len(self.levels[0])

    def root(self, size: int | None = None) -> bytes:
        """Root of the first ``size`` leaves (all by default)."""
        n = self.size if size is None else size
        if not 0 <= n <= self.size:
            raise ValueError(f"tree has {self.size} leaves, not {n}")
        return EMPTY_ROOT if n == 0 else self._range(0, n)

    def _range(self, lo: int, hi: int) -> bytes:
        n = hi - lo
        if n & (n - 1) == 0 and lo % n == 0:
            return self.levels[n.bit_length() - 1][lo // n]
        k = _split(n)
        return node_hash(self._range(lo, lo + k), self._range(lo + k, hi))

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """RFC 6962 audit path for leaf ``index`` in the tree of the first ``size`` leaves."""
        n = self.size if size is None else size
        if not 0 <= index < n <= self.size:
            raise ValueError(f"no leaf {index} in a tree of size {n}")
        return self._path(index, 0, n)

    def _path(self, m: int, lo: int, hi: int) -> list[bytes]:
        n = hi - lo
        if n == 1:
            return []
        k = _split(n)
        if m < k:
            return self._path(m, lo, lo + k) + [self._range(lo + k, hi)]
        return self._path(m - k, lo + k, hi) + [self._range(lo, lo + k)]

    def consistency_proof(self, first: int, second: int | None = None) -> list[bytes]:
        """RFC 6962 proof that the tree of ``first`` leaves is a prefix of that of ``second``."""
        n = self.size if second is None else second
        if not 0 <= first <= n <= self.size:
            raise ValueError(f"no consistency proof from {first} to {n}")
        if first == 0 or first == n:
            return []
        return self._subproof(first, 0, n, True)

    def _subproof(self, m: int, lo: int, hi: int, whole: bool) -> list[bytes]:
        n = hi - lo
        if m == n:
            return [] if whole else [self._range(lo, hi)]
        k = _split(n)
        if m <= k:
            return self._subproof(m, lo, lo + k, whole) + [self._range(lo + k, hi)]
        return self._subproof(m - k, lo + k, hi, False) + [self._range(lo, lo + k)]


def merkle_root(leaf_hashes: Sequence[bytes]) -> bytes:
    """Root of a tree over ``leaf_hashes``."""
    level = list(leaf_hashes)
    if not level:
        return EMPTY_ROOT
    while len(level) > 1:
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _check_hashes(proof: Sequence[bytes], what: str) -> None:
    for h in proof:
        if not isinstance(h, bytes) or len(h) != HASH_SIZE:
            raise VerificationError(f"{what} holds a node that is not a {HASH_SIZE}-byte hash")


def root_from_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes]) -> bytes:
    """Recompute the root that an inclusion proof leads to (RFC 9162 §2.1.3.2)."""
    _check_hashes([leaf, *proof], "inclusion proof")
    if not 0 <= index < size:
        raise VerificationError(f"leaf index {index} is outside a tree of size {size}")
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise VerificationError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationError("inclusion proof is shorter than the tree is deep")
    return r


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> None:
    """Raise unless ``proof`` shows ``leaf`` at ``index`` in the tree with ``root``."""
    if not same(root_from_inclusion(leaf, index, size, proof), root):
        raise VerificationError(f"inclusion proof for leaf {index} of {size} does not reach the root")


def verify_consistency(
    first: int, second: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]
) -> None:
    """Raise unless ``proof`` shows the ``first``-leaf tree is a prefix of the ``second``-leaf one."""
    _check_hashes([first_root, second_root, *proof], "consistency proof")
    if not 0 <= first <= second:
        raise VerificationError(f"tree shrank from {first} to {second} leaves")
    if first == second:
        if proof or not same(first_root, second_root):
            raise VerificationError(f"two different roots for the same size {first}")
        return
    if first == 0:
        if proof or not same(first_root, EMPTY_ROOT):
            raise VerificationError("a consistency proof from the empty tree must be empty")
        return
    if not proof:
        raise VerificationError(f"empty consistency proof from {first} to {second}")
    path = list(proof)
    if first & (first - 1) == 0:
        path.insert(0, first_root)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise VerificationError("consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0 or not same(fr, first_root) or not same(sr, second_root):
        raise VerificationError(f"log of size {second} does not extend the log of size {first}")
