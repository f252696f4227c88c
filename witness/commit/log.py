"""The append-only run log: one canonical-JSON record per leaf of an RFC 6962 tree."""

from __future__ import annotations

from collections.abc import Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .hashing import canonical_json, leaf_hash, same
from .merkle import MerkleTree
from .signing import SignedTreeHead


class RunLog:
    """Records as canonical JSON lines, each a leaf of a Merkle tree (Certificate Transparency style)."""

    def __init__(self, lines: Iterable[bytes] = ()):
        self.lines: list[bytes] = []
        self.tree = MerkleTree()
        for line in lines:
            self.append_line(line)

    def append(self, record: dict) -> bytes:
        """Append a record; returns its canonical line (without newline)."""
        line = canonical_json(record)
        self.append_line(line)
        return line

    def append_line(self, line: bytes) -> None:
        """Append an already-encoded record line."""
        self.lines.append(line)
        self.tree.append(leaf_hash(line))

    def __len__(self) -> int:
        return len(self.lines)

    def root(self, size: int | None = None) -> bytes:
        """Root of the log's first ``size`` records."""
        return self.tree.root(size)

    def extends(self, size: int, root: bytes) -> bool:
        """Whether the log's first ``size`` records have ``root``: it extends a head of that size and root."""
        return size <= len(self) and same(self.root(size), root)

    def sign_head(self, key: Ed25519PrivateKey, timestamp_ms: int | None = None,
                  extensions: dict | None = None) -> SignedTreeHead:
        """Sign the current head."""
        return SignedTreeHead.sign(key, len(self), self.root(), timestamp_ms, extensions)
