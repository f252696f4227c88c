"""A dataset's per-sample commitments: every sample's hash and its documents, in index order.

The dataset root (commitment version 2) is the RFC 6962 root over the leaves
``leaf_hash(sample hash ‖ document key)``: each sample's hash, bound to the documents it holds.
The ``DatasetLeaves`` file publishes those columns. Anyone who has it checks it against the root
by hashing alone, and can then check every step's batch root and rebuild the used-sample and
used-document trees exactly, without the raw data and without replay.

A sample's documents are a list (a packed window of a token stream may span several). Its
**document key** names the list: the document's hash for one, ``tagged_hash(DOCUMENTS_TAG, d₁ ‖ … ‖ dₖ)``
for several. A dataset whose document rule is ``prefix32`` puts that key in the first 32 bytes of
every sample, so a sample's own bytes show which documents it claims; under rule ``self`` a
sample is its own document and its key is its hash.

File layout (little-endian; ``witness-dataset-leaves`` version 1)::

    header  64 bytes: magic "WLEAVES1", samples n (u64), table entries m (u64), rule (u8: 0 self,
            1 prefix32), 7 zero bytes, the dataset root (32 bytes)
    hashes  n × 32 bytes: sample i's hash
    (rule prefix32 only:)
    first   n × u64: where sample i's documents start in the table
    count   n × u16: how many there are; zero-padded to a multiple of 8 bytes
    table   m × 32 bytes: document hashes (sample i's are table[first_i : first_i + count_i])
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..commit.batch import StreamingRoot, leaf_hashes, tagged_many
from ..commit.hashing import leaf_hash, same, tagged_hash
from ..commit.merkle import merkle_root
from ..commit.sorted_tree import pair_leaf
from ..errors import MalformedInput, VerificationError

MAGIC = b"WLEAVES1"
HEADER = struct.Struct("<8sQQB7x32s")
RULES = ("self", "prefix32")
DOCUMENTS_TAG = "witness/documents/v1"
# Leaves are hashed (and the root folded) in chunks of this many samples: memory stays bounded.
CHUNK = 1 << 18
MAX_SAMPLES = 1 << 40


def documents_key(documents: list[bytes]) -> bytes:
    """The 32 bytes that name a sample's list of documents: the document itself when it is one,
    else the tagged hash of the list (a window of only end-of-text tokens lists none)."""
    return documents[0] if len(documents) == 1 else tagged_hash(DOCUMENTS_TAG, b"".join(documents))


def _ranges(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The indices ``first[i] .. first[i] + count[i] - 1`` of every i, concatenated."""
    total = int(count.sum())
    return np.repeat(first - np.cumsum(count) + count, count) + np.arange(total)


def _sorted_unique(rows: np.ndarray) -> np.ndarray:
    """Distinct 32-byte rows in byte order (as the sorted trees order them)."""
    if not len(rows):
        return rows.reshape(0, 32)
    flat = np.ascontiguousarray(rows).view("V32").ravel()
    return np.unique(flat).view(np.uint8).reshape(-1, 32)


def sorted_tree_root(values: np.ndarray) -> tuple[bytes, int]:
    """Root and size of the sorted tree (``SortedTree``) over distinct sorted 32-byte rows, its
    ``n + 1`` pair leaves hashed ``CHUNK`` at a time (memory stays bounded)."""
    m = len(values)
    if m == 0:
        return merkle_root([pair_leaf(None, None)]), 0
    acc = StreamingRoot()
    pending = pair_leaf(None, bytes(values[0]))  # leaves go out in power-of-two chunks, the rest carried
    for lo in range(1, m, CHUNK):  # interior leaves lo..hi-1: flag 3, then the two adjacent values
        hi = min(m, lo + CHUNK)
        pairs = np.empty((hi - lo, 65), np.uint8)
        pairs[:, 0] = 3
        pairs[:, 1:33], pairs[:, 33:] = values[lo - 1:hi - 1], values[lo:hi]
        pending += leaf_hashes(pairs, 65)
        while len(pending) >= 32 * CHUNK:
            acc.add(pending[:32 * CHUNK])
            pending = pending[32 * CHUNK:]
    acc.add(pending + pair_leaf(bytes(values[-1]), None))
    return acc.root(), m


def document_keys(first: np.ndarray, count: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[k, 32]``: the document key of each sample whose documents are ``table[first : first + count]``."""
    first, count, table = np.asarray(first, np.int64), np.asarray(count, np.int64), np.asarray(table)
    keys = np.empty((len(first), 32), np.uint8)
    one = count == 1
    keys[one] = table[first[one]]  # one document: the key is its hash
    other = np.flatnonzero(~one)
    if len(other):  # several (or none): the key hashes the list
        c = count[other]
        lists = np.ascontiguousarray(table[_ranges(first[other], c)])
        offsets = np.zeros(len(c) + 1, "<u8")
        np.cumsum(c * 32, out=offsets[1:])
        keys[other] = np.frombuffer(tagged_many(DOCUMENTS_TAG, lists, offsets), np.uint8).reshape(-1, 32)
    return keys


@dataclass
class DatasetLeaves:
    """The columns of a dataset commitment, as arrays (memory-mapped when read from a file)."""

    rule: str
    hashes: np.ndarray  # [n, 32] uint8
    first: np.ndarray | None = None  # [n] uint64 (rule prefix32)
    count: np.ndarray | None = None  # [n] uint16
    table: np.ndarray | None = None  # [m, 32] uint8

    def __len__(self) -> int:
        return len(self.hashes)

    # --- one sample ---------------------------------------------------------------------
    def sample_hash(self, i: int) -> bytes:
        """Sample ``i``'s hash."""
        return bytes(self.hashes[i])

    def documents(self, i: int) -> list[bytes]:
        """The documents sample ``i`` belongs to."""
        if self.rule == "self":
            return [self.sample_hash(i)]
        lo = int(self.first[i])  # type: ignore[index]
        return [bytes(r) for r in self.table[lo:lo + int(self.count[i])]]  # type: ignore[index]

    def key(self, i: int) -> bytes:
        """Sample ``i``'s document key."""
        return documents_key(self.documents(i))

    # --- whole columns, chunk by chunk --------------------------------------------------
    def keys(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Document keys of samples ``lo`` to ``hi``, ``[k, 32]``."""
        hi = len(self) if hi is None else hi
        if self.rule == "self":
            return np.asarray(self.hashes[lo:hi])
        return document_keys(self.first[lo:hi], self.count[lo:hi], self.table)  # type: ignore[index]

    def leaf_chunks(self, version: int = 2) -> Iterator[bytes]:
        """The commitment's leaf hashes, ``CHUNK`` samples at a time."""
        for lo in range(0, len(self), CHUNK):
            hi = min(len(self), lo + CHUNK)
            if version == 1:
                yield leaf_hashes(np.ascontiguousarray(self.hashes[lo:hi]), 32)
            else:
                yield leaf_hashes(np.concatenate([np.asarray(self.hashes[lo:hi]), self.keys(lo, hi)], axis=1), 64)

    def root(self, version: int = 2) -> bytes:
        """The dataset root: version 2 binds every sample's documents, version 1 its hash alone."""
        acc = StreamingRoot()
        for chunk in self.leaf_chunks(version):
            acc.add(chunk)
        return acc.root()

    def check_root(self, root: bytes, version: int = 2) -> None:
        """Raise unless these leaves hash to the committed dataset ``root``."""
        if not same(self.root(version), root):
            raise VerificationError("the dataset's leaves do not hash to the committed data root", check="data")

    def batch_root(self, indices: Iterable[int]) -> bytes:
        """The Merkle root of a batch's sample hashes, in batch order."""
        return merkle_root([leaf_hash(bytes(self.hashes[i])) for i in indices])

    # --- what a run used ----------------------------------------------------------------
    def used(self, indices: np.ndarray) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
        """Root and size of the sorted used-sample and used-document trees of the samples at
        ``indices`` (any order, repeats allowed)."""
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        samples = _sorted_unique(np.asarray(self.hashes)[idx])
        if self.rule == "self":
            docs = samples
        else:
            first = np.asarray(self.first, dtype=np.int64)[idx]  # type: ignore[arg-type]
            count = np.asarray(self.count, dtype=np.int64)[idx]  # type: ignore[arg-type]
            docs = _sorted_unique(np.asarray(self.table)[np.unique(_ranges(first, count))])
        return sorted_tree_root(samples), sorted_tree_root(docs)

    # --- the file -----------------------------------------------------------------------
    def write(self, path: str | os.PathLike, root: bytes) -> None:
        """Write the leaves file (``root``: the dataset root they hash to)."""
        n = len(self)
        m = 0 if self.table is None else len(self.table)
        with open(path, "wb") as f:
            f.write(HEADER.pack(MAGIC, n, m, RULES.index(self.rule), root))
            f.write(np.ascontiguousarray(self.hashes, np.uint8).tobytes())
            if self.rule != "self":
                f.write(np.asarray(self.first, "<u8").tobytes())
                f.write(np.asarray(self.count, "<u2").tobytes())
                f.write(bytes(-(2 * n) % 8))
                f.write(np.ascontiguousarray(self.table, np.uint8).tobytes())


def leaves_file_size(n: int, m: int, rule: str) -> int:
    """The exact size of a leaves file of ``n`` samples and ``m`` table entries."""
    size = HEADER.size + 32 * n
    if rule != "self":
        size += 8 * n + 2 * n + (-(2 * n) % 8) + 32 * m
    return size


def read_leaves(path: str | os.PathLike, *, samples: int, rule: str) -> tuple[DatasetLeaves, bytes]:
    """Open a leaves file strictly (memory-mapped) for a dataset of ``samples`` samples whose task
    decides ``rule``; returns the leaves and the root its header names (check it with
    ``check_root``: the header is the file's claim, not a proof)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER.size:
        raise MalformedInput(f"{path.name} is too short to be a dataset leaves file")
    with open(path, "rb") as f:
        magic, n, m, rule_id, root = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise MalformedInput(f"{path.name} is not a witness dataset leaves file of a supported version")
    if rule_id >= len(RULES):
        raise MalformedInput(f"{path.name} names an unknown document rule")
    if RULES[rule_id] != rule:
        raise VerificationError(f"the dataset leaves give documents under rule {RULES[rule_id]!r}; the run's task "
                                f"decides {rule!r}", check="data usage")
    if n != samples or not 0 < n <= MAX_SAMPLES or m > 64 * MAX_SAMPLES or (rule == "self" and m):
        raise MalformedInput(f"{path.name} holds {n} samples; the run committed a dataset of {samples}")
    if size != leaves_file_size(n, m, rule):
        raise MalformedInput(f"{path.name} is {size} bytes; {n} samples and {m} documents take "
                             f"{leaves_file_size(n, m, rule)}")
    at = HEADER.size
    hashes = np.memmap(path, np.uint8, "r", at, (n, 32))
    if rule == "self":
        return DatasetLeaves(rule, hashes), root
    at += 32 * n
    first = np.memmap(path, "<u8", "r", at, (n,))
    at += 8 * n
    count = np.memmap(path, "<u2", "r", at, (n,))
    at += 2 * n + (-(2 * n) % 8)
    table = np.memmap(path, np.uint8, "r", at, (m, 32)) if m else np.zeros((0, 32), np.uint8)
    for lo in range(0, n, CHUNK):  # every sample's documents lie inside the table
        f, c = first[lo:lo + CHUNK].astype(np.uint64), count[lo:lo + CHUNK].astype(np.uint64)
        if (f > m).any() or (f + c > m).any():
            raise MalformedInput(f"{path.name}: a sample's documents lie outside the document table")
    return DatasetLeaves(rule, hashes, first, count, table), root
