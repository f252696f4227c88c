"""What a run actually used: sorted trees of the distinct samples and documents it trained on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..commit.sorted_tree import SortedTree
from .dataset import Dataset
from .leaves import DatasetLeaves


def used_indices(batches: Iterable[Iterable[int]]) -> np.ndarray:
    """Every dataset index the batches name, once, ascending."""
    parts = [np.asarray(list(b), dtype=np.int64) for b in batches]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def usage_json(rule: str, samples: tuple[bytes, int], documents: tuple[bytes, int]) -> dict:
    """The fields of the end record (and the final head's extensions) that commit to the usage."""
    return {
        "document_rule": rule,
        "used_documents": {"root": documents[0].hex(), "size": documents[1]},
        "used_samples": {"root": samples[0].hex(), "size": samples[1]},
    }


def used_roots(leaves: DatasetLeaves, batches: Iterable[Iterable[int]]) -> dict:
    """The usage commitment of the batches, from the dataset's leaves alone (hashing, no data)."""
    samples, documents = leaves.used(used_indices(batches))
    return usage_json(leaves.rule, samples, documents)


@dataclass
class UsageCommitment:
    """Sorted trees of the used sample hashes and the used document hashes, with their proofs."""

    samples: SortedTree
    documents: SortedTree
    document_rule: str

    @classmethod
    def from_batches(cls, dataset: Dataset, batches: Iterable[Iterable[int]]) -> UsageCommitment:
        """Build from the batches' dataset indices (every step's, in any order)."""
        leaves = dataset.leaves
        used = used_indices(batches)
        documents = {d for i in used for d in leaves.documents(int(i))}
        return cls(SortedTree(leaves.sample_hash(int(i)) for i in used), SortedTree(documents), leaves.rule)

    def to_json(self) -> dict:
        """The fields of the end record that commit to the usage."""
        return usage_json(self.document_rule, (self.samples.root, self.samples.size),
                          (self.documents.root, self.documents.size))
