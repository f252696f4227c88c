"""The Python standard library's own source files as a text corpus (no download, no torch)."""

from __future__ import annotations

import sysconfig
from functools import cached_property
from pathlib import Path

from ..commit.hashing import tagged_hash
from .dataset import Dataset

DOCUMENT_TAG = "witness/document/v1"
# Folders that hold test suites or third-party code, not the library itself.
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def document_hash(content: bytes) -> bytes:
    """The hash that names a document: tagged SHA-256 of its bytes (its path does not matter)."""
    return tagged_hash(DOCUMENT_TAG, content)


def is_eval_document(relpath: str) -> bool:
    """Whether a file is held out for evaluation (about 1 in 16, decided by its path)."""
    return tagged_hash("witness/split/v1", relpath.encode())[0] < 16


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_documents(root: Path | None = None, max_bytes: int | None = None) -> list[tuple[str, bytes]]:
    """Every ``.py`` file under the stdlib (sorted by relative path), tests excluded."""
    base = Path(root) if root is not None else stdlib_root()
    docs: list[tuple[str, bytes]] = []
    total = 0
    for path in sorted(base.rglob("*.py"), key=lambda p: p.relative_to(base).as_posix()):
        rel = path.relative_to(base).as_posix()
        if EXCLUDED_PARTS.intersection(rel.split("/")[:-1]) or path.is_symlink():
            continue
        data = path.read_bytes()
        docs.append((rel, data))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return docs


class StdlibWindows(Dataset):
    """Byte windows of ``block + 1`` bytes, stride ``block``, over the train or eval documents.

    A sample's canonical bytes are ``document hash (32) || offset (8, big-endian) || window``,
    so every sample names the document it came from.
    """

    name = "stdlib-windows"
    DOCUMENT_RULE = "prefix32"

    def __init__(self, block: int, split: str = "train", max_bytes: int | None = None, root: Path | None = None):
        if split not in ("train", "eval"):
            raise ValueError("split is train or eval")
        self.block = block
        self.split = split
        docs = [
            (rel, data)
            for rel, data in list_documents(root, max_bytes)
            if is_eval_document(rel) == (split == "eval")
        ]
        self.documents = docs
        self.windows: list[tuple[int, int]] = []
        for d, (_, data) in enumerate(docs):
            for off in range(0, len(data) - block, block):
                self.windows.append((d, off))

    @cached_property
    def document_hashes(self) -> list[bytes]:
        """Hash of every document of this split, in order."""
        return [document_hash(data) for _, data in self.documents]

    def __len__(self) -> int:
        return len(self.windows)

    def sample_bytes(self, index: int) -> bytes:
        """Canonical bytes of window ``index``."""
        d, off = self.windows[index]
        data = self.documents[d][1]
        return self.document_hashes[d] + off.to_bytes(8, "big") + data[off : off + self.block + 1]


    def document_hash(self, content: bytes) -> bytes:
        """Hash of a source file's bytes."""
        return document_hash(content)

    def documents_list(self) -> list[tuple[str, bytes, bytes]]:
        """Every source file of this split: (relative path, hash, content)."""
        return [(rel, h, data) for (rel, data), h in zip(self.documents, self.document_hashes, strict=True)]


def window_tokens(canonical: bytes) -> bytes:
    """The text bytes of a window's canonical form."""
    return canonical[40:]
