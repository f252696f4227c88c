"""A small synthetic classification dataset generated from a fixed seed (no download, no torch)."""

from __future__ import annotations

from ..commit.hashing import tagged_hash
from .dataset import Dataset


class SyntheticClassification(Dataset):
    """``size`` samples of ``features`` signed bytes plus a label from a fixed linear teacher.

    Canonical bytes: ``features`` int8 values, then one label byte. Identical on every machine.
    """

    name = "synthetic-classification"

    def __init__(self, size: int = 2048, features: int = 8, classes: int = 4, seed: bytes = b"tiny",
                 split: bytes = b"", leak: SyntheticClassification | None = None, leak_count: int = 0):
        self.size, self.features, self.classes, self.seed = size, features, classes, seed
        self.split = split  # another split draws from another stream of the same teacher
        self.leak, self.leak_count = leak, leak_count
        t = tagged_hash("witness/synthetic/teacher", seed)
        self.teacher = [[(t[(c * features + f) % 32] % 7) - 3 for f in range(features)] for c in range(classes)]

    def __len__(self) -> int:
        return self.size

    def sample_bytes(self, index: int) -> bytes:
        """Features then label, deterministically derived from the seed and the index."""
        if self.leak is not None and index >= self.size - self.leak_count:
            return self.leak.sample_bytes(index - (self.size - self.leak_count))
        stream = self.seed + self.split
        raw = tagged_hash("witness/synthetic/sample", stream, index.to_bytes(8, "big"))
        for block in range(1, -(-self.features // 32)):  # more than 32 features: more blocks
            raw += tagged_hash("witness/synthetic/sample", stream, index.to_bytes(8, "big"), block.to_bytes(4, "big"))
        feats = [b - 256 if b > 127 else b for b in raw[: self.features]]
        scores = [sum(w * x for w, x in zip(row, feats, strict=True)) for row in self.teacher]
        label = max(range(self.classes), key=lambda c: scores[c])
        return bytes(b & 0xFF for b in feats) + bytes([label])
