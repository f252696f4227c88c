"""The openings' paths: a batch of windows' opened chunks laid out as rows, their padding, and the
check that each leads to what its state's record commits: the chunk tree's ``param_root`` (version 3),
or the state hash itself through the tensor's BLAKE3 tree and its leaf (version 4,
``witness.bundle.opened``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..bundle.opened import ModelLeaves, tree_paths
from ..commit.chunks import chunk_leaves, verify_paths, wrap_roots
from ..commit.hashing import same
from ..errors import VerificationError
from ..fingerprint.chunks import ChunkLayout


class MoveFailure(VerificationError):
    """A window's openings that do not hold: ``window`` is the head size it closes at (so a leaderboard
    names that file; a step alone is ambiguous where windows share the state between them)."""

    def __init__(self, message: str, *, window: int, step: int | None = None, check: str | None = "moves"):
        super().__init__(message, step=step, check=check)
        self.window = window


@dataclass
class Batch:
    """Some windows' openings as rows: one row a state's opened chunk, windows one after the other,
    a window's rows state by state (``k`` chunks each, in the window's order)."""

    reads: list
    data: np.ndarray  # [rows, chunk bytes]
    chunk: np.ndarray  # [rows] the chunk's index
    state: np.ndarray  # [rows] the state (its update count)
    nodes: np.ndarray  # [nodes, 32] every path's nodes
    starts: np.ndarray  # [rows] where each row's path begins in nodes

    @classmethod
    def of(cls, reads: list, cb: int, lengths: Callable[[int, np.ndarray], np.ndarray]) -> Batch:
        """Lay the windows' openings out as rows (window by window, then state by state); ``lengths(t,
        chunks)`` says how many path nodes each chunk's opening has in the state after ``t`` updates."""
        chunk, state, starts, base = [], [], [], 0
        for d, cs, op in reads:
            ids = np.asarray(cs, dtype=np.int64)
            at = base
            for t in range(d.steps.start, d.steps.start + op.chunks.shape[0]):
                lens = lengths(t, ids)
                starts.append(at + np.cumsum(lens) - lens)
                at += int(lens.sum())
                state.append(np.full(len(ids), t, dtype=np.int64))
                chunk.append(ids)
            base += op.paths.size // 32
        data = np.concatenate([op.chunks.reshape(-1, cb) for _, _, op in reads])
        nodes = np.concatenate([op.paths.reshape(-1, 32) for _, _, op in reads])
        return cls(reads, data, np.concatenate(chunk), np.concatenate(state), nodes, np.concatenate(starts))

    def where(self, row: int) -> tuple:
        """(the window's draw, its chunks, the row's chunk position) of a row."""
        for d, chunks, op in self.reads:
            n = op.chunks.shape[0] * op.chunks.shape[1]
            if row < n:
                return d, chunks, row % op.chunks.shape[1]
            row -= n
        raise IndexError(row)


def check_padding(batch: Batch, layout: ChunkLayout) -> None:
    """Every opened chunk is zero past its tensor's end (the layout pads so): the bytes of a chunk are
    then exactly its tensor's values, and a root committed over other padding is refused here."""
    tensor = layout.tensor_of(batch.chunk)
    used = np.clip(layout.ends[tensor] - batch.chunk * layout.chunk_bytes, 0, layout.chunk_bytes)  # its data bytes
    rows = np.nonzero(used < layout.chunk_bytes)[0]  # a tensor's last chunk: the only ones with padding
    pad = np.zeros(len(batch.chunk), dtype=bool)
    pad[rows] = ((batch.data[rows] != 0) & (np.arange(layout.chunk_bytes)[None, :] >= used[rows, None])).any(axis=1)
    if pad.any():
        r = int(np.nonzero(pad)[0][0])
        d, _, _ = batch.where(r)
        state = int(batch.state[r])
        raise MoveFailure(f"chunk {int(batch.chunk[r])} ({layout.tensors[tensor[r]][0]}) of the state after "
                          f"{state} update(s), opened for the window closing at size {d.size}, holds bytes past the "
                          "tensor's end, where the layout pads with zeros", step=max(state - 1, 0), window=d.size)


def check_paths(batch: Batch, layout: ChunkLayout, roots: list[bytes | None]) -> None:
    """Every opened chunk's path leads to its state's committed root (all the batch's rows at once)."""
    size = layout.size
    leaves = np.frombuffer(chunk_leaves(batch.data, layout.chunk_bytes), dtype=np.uint8).reshape(-1, 32)
    tops = verify_paths(leaves, batch.chunk, size, batch.nodes, batch.starts)
    # every row of a state must reach the same tree root, and that root (bound to the layout) the record's
    k = batch.reads[0][2].chunks.shape[1]
    per_state = tops.reshape(-1, k, 32)
    state = batch.state[::k]
    want = np.frombuffer(b"".join(roots[t] or bytes(32) for t in state), dtype=np.uint8).reshape(-1, 32)
    wrapped = wrap_roots(layout.id, size, np.ascontiguousarray(per_state[:, 0]))
    bad = (per_state != per_state[:, :1]).any(axis=2).any(axis=1) | (wrapped != want).any(axis=1) | \
        np.array([roots[t] is None for t in state])
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        split = np.nonzero((per_state[i] != per_state[i, :1]).any(axis=1))[0]
        d, chunks, _ = batch.where(i * k)
        t = int(state[i])
        raise MoveFailure(f"chunk {chunks[int(split[0]) if split.size else 0]} of the state after {t} update(s), "
                          f"opened for the window closing at size {d.size}, does not lead to the param_root its "
                          "record commits (a chunk or a path was changed, or the root commits other parameters)",
                          step=max(t - 1, 0), window=d.size)


def check_tree_paths(batch: Batch, leaves: ModelLeaves, digest: str, hashes: list[bytes | None],
                     sizes: list[int | None]) -> None:
    """Every opened chunk leads, through its tensor's BLAKE3 tree and leaf, to the state hash its
    state's record commits, in a state tree of the record's ``state_leaves`` (all rows at once)."""
    size = np.array([sizes[t] or 0 for t in batch.state], dtype=np.int64)
    tops = tree_paths(leaves, digest, batch.data, batch.chunk, size, batch.nodes, batch.starts)
    for r, top in enumerate(tops):
        t = int(batch.state[r])
        want = hashes[t]
        if top is None or want is None or not same(top, want):
            d, _, _ = batch.where(r)
            raise MoveFailure(f"chunk {int(batch.chunk[r])} of the state after {t} update(s), opened for the window "
                              f"closing at size {d.size}, does not lead to the state hash its record commits (a chunk "
                              "or a path was changed, the tensor's leaf is not where the state's "
                              f"{sizes[t]} leaves put it, or the hash commits other parameters)",
                              step=max(t - 1, 0), window=d.size)
