"""Appending to a bundle: records and signed tree heads, flushed so a killed run loses nothing signed."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from ..commit.hashing import canonical_json
from ..commit.signing import SignedTreeHead
from .layout import CHECKPOINTS, HEADS, LEAVES, LOG, MARKER, ONLINE, PROBES, marker_bytes


class BundleWriter:
    """Owns the open log and heads files of a bundle being written."""

    def __init__(self, root: Path, create: bool):
        self.root = Path(root)
        if create:
            if self.root.exists() and any(self.root.iterdir()):
                if not started_without_steps(self.root):
                    raise FileExistsError(f"{self.root} exists and is not empty (use --resume to continue a run)")
                # a run that stopped before its first step signed nothing worth keeping: start again
                shutil.rmtree(self.root)
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


# What a run writes before its first step: a folder holding only these is a start, not a run.
_START_FILES = {MARKER, LOG, HEADS, CHECKPOINTS, LEAVES, PROBES, ONLINE}


def started_without_steps(root: Path) -> bool:
    """Whether ``root`` is a bundle that a run began and left before its first step was recorded
    (a crash while it committed its data or took its first step): nothing in it to resume."""
    root = Path(root)
    if root.is_symlink() or not (root / MARKER).is_file() or (root / MARKER).read_bytes() != marker_bytes():
        return False
    if any(p.name not in _START_FILES for p in root.iterdir()):
        return False
    log = root / LOG
    return not log.exists() or log.read_bytes().count(b"\n") <= 1  # the manifest at most


MAX_LINES_BYTES = 1 << 33  # a run's own log of millions of steps; a journal is far smaller


def read_lines(path: Path, limit: int = MAX_LINES_BYTES) -> list[bytes]:
    """Complete lines of a JSON-lines file of a run's folder (a torn last line is dropped). A file that is not a
    regular one (a FIFO would hang the read, /dev/zero fill memory) or is over ``limit`` bytes (a sparse file)
    is a ``ValueError`` that says so."""
    if not path.exists():
        return []
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file: the run's folder holds only files it wrote")
    if st.st_size > limit:
        raise ValueError(f"{path} is {st.st_size} bytes, over the {limit} a run writes there")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} grew past {limit} bytes while it was read")
    return data.split(b"\n")[:-1]


def truncate_lines(path: Path, keep: int) -> None:
    """Keep only the first ``keep`` complete lines of a file."""
    lines = read_lines(path)[:keep]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in lines))
    os.replace(tmp, path)


def head_sizes(path: Path) -> list[int]:
    """Sizes of the heads in a heads file (for resuming)."""
    return [json.loads(line)["size"] for line in read_lines(path)]
