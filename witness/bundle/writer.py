"""Appending to a bundle: records and signed tree heads, flushed so a killed run loses nothing signed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..commit.hashing import canonical_json
from ..commit.signing import SignedTreeHead
from .layout import CHECKPOINTS, HEADS, LOG, MARKER, marker_bytes


class BundleWriter:
    """Owns the open log and heads files of a bundle being written."""

    def __init__(self, root: Path, create: bool):
        self.root = Path(root)
        if create:
            if self.root.exists() and any(self.root.iterdir()):
                raise FileExistsError(f"{self.root} exists and is not empty (use --resume to continue a run)")
            (self.root / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
            (self.root / MARKER).write_bytes(marker_bytes())
        self._log = open(self.root / LOG, "ab")
        self._heads = open(self.root / HEADS, "ab")

    def append_record(self, line: bytes) -> None:
        """Append one canonical record line; flushed to the OS (survives ``kill -9``)."""
        self._log.write(line + b"\n")
        self._log.flush()

    def append_head(self, head: SignedTreeHead) -> None:
        """Make the log durable, then append a signed tree head (so no head outlives its records)."""
        os.fsync(self._log.fileno())
        self._heads.write(canonical_json(head.to_json()) + b"\n")
        self._heads.flush()
        os.fsync(self._heads.fileno())

    def close(self) -> None:
        """Close both files."""
        self._log.close()
        self._heads.close()


def read_lines(path: Path) -> list[bytes]:
    """Complete lines of a JSON-lines file (a torn last line is dropped)."""
    if not path.exists():
        return []
    parts = path.read_bytes().split(b"\n")
    return parts[:-1]


def truncate_lines(path: Path, keep: int) -> None:
    """Keep only the first ``keep`` complete lines of a file."""
    lines = read_lines(path)[:keep]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in lines))
    os.replace(tmp, path)


def head_sizes(path: Path) -> list[int]:
    """Sizes of the heads in a heads file (for resuming)."""
    return [json.loads(line)["size"] for line in read_lines(path)]
