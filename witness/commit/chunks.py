"""Parameter chunks: the Merkle root an online run's step record commits over its parameters, the
chunks a window's randomness opens, and the paths that open them. Hashing only (no torch).

The parameters, laid out tensor after tensor (sorted by name, each starting on a chunk boundary and
zero-padded to a whole chunk), are cut into chunks of ``chunk_bytes``. Each chunk's leaf is
``tagged_hash(CHUNK_TAG, chunk)``; the leaves make an RFC 6962 tree, and the record's ``param_root``
binds that tree to its layout:

    param_root = tagged_hash(ROOT_TAG, layout id, number of chunks as 8 big-endian bytes, tree root)

A chunk's position is bound by its path (RFC 6962 paths fix the leaf index within a tree of known
size) and its tensor by the layout, which the verifier derives from the task's own model, never from
the bundle: hashing either into every leaf would cost a fifth more per step and bind nothing more.

Each window's beta opens ``k`` chunks (``chunk_indices``) of every state the window's steps go from
and to; ``verify_paths`` checks many openings at once, level by level.
"""

from __future__ import annotations

import numpy as np

from .batch import node_hashes, tagged_many, tree_levels
from .hashing import tagged_hash, tagged_hashes

CHUNK_TAG = "witness/param-chunk/v1"
ROOT_TAG = "witness/param-root/v1"
SELECT_TAG = "witness/online-chunks/v1"
MAX_CHUNKS = 1 << 40  # chunks in a layout (a trillion parameters in 1 KiB chunks fit)


def chunk_leaves(data: bytes | memoryview | np.ndarray, chunk_bytes: int, threads: int | None = None) -> bytes:
    """The leaf hash of every ``chunk_bytes``-byte chunk of ``data``, concatenated."""
    return tagged_many(CHUNK_TAG, data, chunk_bytes, threads)


def wrap_root(layout: bytes, size: int, tree_root: bytes) -> bytes:
    """The ``param_root`` a record commits: the chunk tree's root, bound to its layout and size."""
    return tagged_hash(ROOT_TAG, layout, size.to_bytes(8, "big"), tree_root)


def wrap_roots(layout: bytes, size: int, tree_roots: np.ndarray) -> np.ndarray:
    """``wrap_root`` of many tree roots ([m, 32] uint8) at once: the fixed prefix is hashed once."""
    out = tagged_hashes(ROOT_TAG, (layout, size.to_bytes(8, "big")), (r.tobytes() for r in tree_roots))
    return np.frombuffer(b"".join(out), dtype=np.uint8).reshape(-1, 32)


def chunk_indices(beta: bytes, k: int, size: int) -> list[int]:
    """The ``k`` distinct chunks (all, if there are no more) that ``beta`` opens, ascending."""
    if k >= size:
        return list(range(size))
    out: set[int] = set()
    i = 0
    while len(out) < k:  # a 64-bit draw reduced mod size: its bias (size / 2^64) is nothing to exploit
        x = int.from_bytes(tagged_hash(SELECT_TAG, beta, i.to_bytes(8, "big"))[:8], "big")
        out.add(x % size)
        i += 1
    return sorted(out)


def level_sizes(size: int) -> list[int]:
    """The number of nodes at each level of an RFC 6962 tree of ``size`` leaves, leaves first."""
    out = [size]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


def path_nodes(index: int, size: int) -> list[tuple[int, int]]:
    """The (level, position) of each node on the path of leaf ``index``, bottom up: a level whose
    node is the odd one out (promoted unchanged) has none."""
    out = []
    for level, n in enumerate(level_sizes(size)[:-1]):
        pos = index >> level
        if pos ^ 1 < n:
            out.append((level, pos ^ 1))
    return out


class ChunkTree:
    """Every level of one state's chunk tree (leaves first, root last): its root and its paths."""

    def __init__(self, leaves: bytes, layout: bytes, threads: int | None = None):
        self.size = len(leaves) // 32
        self.levels = np.frombuffer(tree_levels(leaves, threads), dtype=np.uint8).reshape(-1, 32)
        self.root = wrap_root(layout, self.size, self.levels[-1].tobytes())
        self._starts = np.cumsum([0, *level_sizes(self.size)[:-1]])

    def paths(self, indices: list[int]) -> np.ndarray:
        """The paths of the leaves ``indices``, one after the other (``[nodes, 32]`` uint8)."""
        rows = [self._starts[level] + pos for i in indices for level, pos in path_nodes(i, self.size)]
        return self.levels[np.asarray(rows, dtype=np.int64)] if rows else np.zeros((0, 32), np.uint8)


def verify_paths(leaves: np.ndarray, indices: np.ndarray, size: int, nodes: np.ndarray,
                 starts: np.ndarray) -> np.ndarray:
    """The tree root each of R openings leads to: ``leaves`` [R, 32] (the openings' leaf hashes),
    ``indices`` [R] their leaf indices in a tree of ``size`` leaves, ``nodes`` [M, 32] every path's
    nodes, and ``starts`` [R] where each opening's path begins in ``nodes`` (its length is the one
    ``path_nodes`` gives). Checked level by level for all openings at once ([R, 32] uint8)."""
    cur = np.array(leaves, dtype=np.uint8, copy=True)
    ptr = np.array(starts, dtype=np.int64, copy=True)
    idx = np.asarray(indices, dtype=np.int64)
    for level, n in enumerate(level_sizes(size)[:-1]):
        pos = idx >> level
        has = (pos ^ 1) < n
        if not has.any():
            continue
        rows = np.nonzero(has)[0]
        sib = nodes[ptr[rows]]
        left = (pos[rows] & 1).astype(bool)[:, None]
        pairs = np.concatenate([np.where(left, sib, cur[rows]), np.where(left, cur[rows], sib)], axis=1)
        cur[rows] = np.frombuffer(node_hashes(np.ascontiguousarray(pairs)), dtype=np.uint8).reshape(-1, 32)
        ptr[rows] += 1
    return cur
