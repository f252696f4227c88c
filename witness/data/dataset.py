"""Datasets as sequences of canonical sample bytes, and their Merkle commitments."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from ..commit.batch import tagged_many
from ..commit.hashing import leaf_hash, tagged_hash
from ..commit.merkle import MerkleTree, merkle_root
from .leaves import CHUNK, DatasetLeaves, documents_key

SAMPLE_TAG = "witness/sample/v1"
# The dataset commitment a run names in its manifest (``data_commitment``): version 2 binds each
# sample's documents into its leaf; version 1 (runs before witness 0.5) bound the sample alone.
DATA_COMMITMENT = 2


def sample_hash(canonical: bytes) -> bytes:
    """The hash that names a sample: tagged SHA-256 of its canonical bytes."""
    return tagged_hash(SAMPLE_TAG, canonical)


def sample_hashes(samples: Sequence[bytes]) -> np.ndarray:
    """``sample_hash`` of every sample, ``[n, 32]``, hashed in batches (natively where built)."""
    out = np.empty((len(samples), 32), np.uint8)
    for lo in range(0, len(samples), CHUNK):
        part = samples[lo:lo + CHUNK]
        offsets = np.zeros(len(part) + 1, "<u8")
        np.cumsum([len(s) for s in part], out=offsets[1:])
        out[lo:lo + len(part)] = np.frombuffer(tagged_many(SAMPLE_TAG, b"".join(part), offsets), np.uint8).reshape(-1, 32)
    return out


def batch_root(sample_hashes: Sequence[bytes]) -> bytes:
    """Merkle root of a batch's sample hashes, in batch order."""
    return merkle_root([leaf_hash(h) for h in sample_hashes])


class Dataset:
    """A dataset in its own order: index -> canonical bytes, committed by a Merkle root.

    Subclasses implement ``__len__`` and ``sample_bytes``; the commitment is a Merkle tree whose
    leaf ``i`` is ``leaf_hash(sample_hash(sample_bytes(i)) ‖ document key of sample i)``
    (``leaves.py``). A corpus too large to hold as Python objects builds its ``leaves`` itself.
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
        return [bytes(h) for h in self.leaves.hashes]

    @cached_property
    def leaves(self) -> DatasetLeaves:
        """The commitment's columns: every sample's hash and its documents, in index order."""
        samples = [self.sample_bytes(i) for i in range(len(self))]
        hashes = sample_hashes(samples)
        if self.DOCUMENT_RULE == "self":
            return DatasetLeaves("self", hashes)
        first, count = np.empty(len(self), np.uint64), np.empty(len(self), np.uint16)
        table: list[bytes] = []
        previous: list[bytes] = []
        for i, s in enumerate(samples):
            docs = self.sample_documents(i, s)
            if documents_key(docs) != self.document_of(s):
                raise ValueError(f"sample {i} names other documents in its bytes than the dataset lists")
            if docs != previous:  # windows of one document share its table entry
                previous = docs
                table.extend(docs)
            first[i], count[i] = len(table) - len(docs), len(docs)
        table_array = np.frombuffer(b"".join(table), np.uint8).reshape(-1, 32)
        return DatasetLeaves("prefix32", hashes, first, count, table_array)

    @cached_property
    def root(self) -> bytes:
        """The dataset commitment (version 2: each leaf binds a sample and its documents)."""
        return self.leaves.root(DATA_COMMITMENT)

    def commitment_root(self, version: int) -> bytes:
        """The dataset root under commitment ``version`` (1: what runs before witness 0.5 committed)."""
        return self.root if version == DATA_COMMITMENT else self.tree.root()

    @cached_property
    def tree(self) -> MerkleTree:
        """The version 1 commitment tree (leaf ``i`` is the sample's hash alone), for older runs."""
        return MerkleTree([leaf_hash(h) for h in self.hashes])

    def batch_root(self, indices: Sequence[int]) -> bytes:
        """Batch root for the given sample indices."""
        return batch_root([self.hashes[i] for i in indices])

    # A sample belongs to a document. By default a sample is its own document; datasets whose
    # samples are windows into documents say so with DOCUMENT_RULE = "prefix32" and put the
    # document's hash in the first 32 bytes of every sample.
    DOCUMENT_RULE = "self"

    def document_of(self, canonical: bytes) -> bytes:
        """The document key a sample (canonical bytes) names: its document's hash, or under rule
        ``prefix32`` the key of its documents' list (``leaves.documents_key``)."""
        return document_of(self.DOCUMENT_RULE, canonical)

    def sample_documents(self, index: int, canonical: bytes) -> list[bytes]:
        """The documents sample ``index`` (with these canonical bytes) belongs to: by default the
        one its key names. A dataset whose samples may span documents says which."""
        return [self.document_of(canonical)]

    def document_hash(self, content: bytes) -> bytes:
        """Hash of a document given as raw bytes (what a query names with --file or --text)."""
        return sample_hash(content)

    # bytes a unit of the samples takes (a token dataset's width): a text is found only where it starts
    # on a unit, never across two tokens
    unit = 1

    def contains(self, content: bytes, needle: bytes) -> bool:
        """Whether a sample's or document's bytes hold ``needle``, starting on a unit boundary."""
        at = content.find(needle)
        while at >= 0 and at % self.unit:
            at = content.find(needle, at + 1)
        return at >= 0

    def text_bytes(self, text: str) -> bytes:
        """What a text is in this dataset's samples and documents (a ``--text`` query): its UTF-8
        bytes; a dataset of tokens encodes it with its tokenizer."""
        return text.encode("utf-8")

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
