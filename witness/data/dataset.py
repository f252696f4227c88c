"""Datasets as sequences of canonical sample bytes, and their Merkle commitments."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from ..commit.hashing import leaf_hash, tagged_hash
from ..commit.merkle import MerkleTree, merkle_root

SAMPLE_TAG = "witness/sample/v1"


def sample_hash(canonical: bytes) -> bytes:
    """The hash that names a sample: tagged SHA-256 of its canonical bytes."""
    return tagged_hash(SAMPLE_TAG, canonical)


def batch_root(sample_hashes: Sequence[bytes]) -> bytes:
    """Merkle root of a batch's sample hashes, in batch order."""
    return merkle_root([leaf_hash(h) for h in sample_hashes])


class Dataset:
    """A dataset in its own order: index -> canonical bytes, committed by a Merkle root.

    Subclasses implement ``__len__`` and ``sample_bytes``; the commitment is a Merkle tree
    whose leaf ``i`` is ``leaf_hash(sample_hash(sample_bytes(i)))``.
    """

    name = "dataset"

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_bytes(self, index: int) -> bytes:
        """Canonical bytes of sample ``index``."""
        raise NotImplementedError

    def sample_hash(self, index: int) -> bytes:
        """Hash of sample ``index``."""
        return self.hashes[index]

    @cached_property
    def hashes(self) -> list[bytes]:
        """Every sample's hash, in dataset order."""
        return [sample_hash(self.sample_bytes(i)) for i in range(len(self))]

    @cached_property
    def tree(self) -> MerkleTree:
        """The dataset commitment tree (index order)."""
        return MerkleTree([leaf_hash(h) for h in self.hashes])

    @property
    def root(self) -> bytes:
        """The dataset commitment."""
        return self.tree.root()

    def batch_root(self, indices: Sequence[int]) -> bytes:
        """Batch root for the given sample indices."""
        return batch_root([self.hashes[i] for i in indices])

    # A sample belongs to a document. By default a sample is its own document; datasets whose
    # samples are windows into documents say so with DOCUMENT_RULE = "prefix32" and put the
    # document's hash in the first 32 bytes of every sample.
    DOCUMENT_RULE = "self"

    def document_of(self, canonical: bytes) -> bytes:
        """Hash of the document a sample (canonical bytes) belongs to."""
        return document_of(self.DOCUMENT_RULE, canonical)

    def document_hash(self, content: bytes) -> bytes:
        """Hash of a document given as raw bytes (what a query names with --file or --text)."""
        return sample_hash(content)

    def documents_list(self) -> list[tuple[str, bytes, bytes]]:
        """Every document of the dataset: (name, hash, content). By default each sample is one."""
        return [(f"sample {i}", self.document_of(self.sample_bytes(i)), self.sample_bytes(i)) for i in range(len(self))]


def document_of(rule: str, canonical: bytes) -> bytes:
    """The document hash of a sample under a committed document rule."""
    if rule == "self":
        return sample_hash(canonical)
    if rule == "prefix32":
        if len(canonical) < 32:
            raise ValueError("sample too short to name its document")
        return canonical[:32]
    raise ValueError(f"unknown document rule {rule!r}")
