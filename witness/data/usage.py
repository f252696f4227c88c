"""What a run actually used: sorted trees of the distinct samples and documents it trained on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..commit.sorted_tree import SortedTree
from .dataset import Dataset


@dataclass
class UsageCommitment:
    """Sorted trees of the used sample hashes and the used document hashes."""

    samples: SortedTree
    documents: SortedTree
    document_rule: str

    @classmethod
    def from_batches(cls, dataset: Dataset, batches: Iterable[Iterable[int]]) -> UsageCommitment:
        """Build from the batches' dataset indices (every step's, in any order)."""
        used = set()
        for batch in batches:
            used.update(batch)
        samples = SortedTree(dataset.hashes[i] for i in used)
        documents = SortedTree(dataset.document_of(dataset.sample_bytes(i)) for i in used)
        return cls(samples, documents, dataset.DOCUMENT_RULE)

    def to_json(self) -> dict:
        """The fields of the end record that commit to the usage."""
        return {
            "document_rule": self.document_rule,
            "used_documents": {"root": self.documents.root.hex(), "size": self.documents.size},
            "used_samples": {"root": self.samples.root.hex(), "size": self.samples.size},
        }
