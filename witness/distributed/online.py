"""Online challenges under torchrun: every rank keeps its own share of each state in its own ring.

Rank 0 holds the beacon's link (``witness.record.online.OnlineChallenges``, keeping rank 0's share
of each state): it sends the run's heads and receives the statements, one log and one draw per
window, as in one process. As each statement is answered there, it notes what the window covers
and which states it asks for (``Answers``). At each step's record rank 0 first keeps its share of
the new state (waiting for the beacon when its ring is full), then broadcasts the notes taken
since the last record (``exchange``); every other rank (a ``ShareRing``) writes its share of the
states asked for, frees the rest of the window, and only then keeps its share of the new state.
So another rank's ring never holds more states than rank 0's, and each rank holds, hashes and
writes about 1/ranks of every state. The shares' files are ``online/states/<n>.rank<r>.safetensors``
(docs/format.md); a verifier joins them and checks the whole against the committed state hash.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..bundle.checkpoint import write_state
from ..bundle.layout import online_shard_name
from ..bundle.opened import ShardedState, TensorTrees
from ..commit.chunks import ChunkTree
from ..fingerprint.chunks import ChunkLayout
from ..record.kept import StatePool

# what a window opens of a chunked run's states: (the head size it closes at, its first state, its last
# state, the chunks its beta opens), None where nothing
Window = tuple[int, int, int, list[int]] | None
# (steps covered so far, the states a window asks for, what it opens), in answer order
Notes = list[tuple[int, list[int], Window]]


class Answers:
    """Rank 0's notes of the statements answered so far: taken by the beacon's thread, sent at each record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notes: Notes = []

    def note(self, covered: int, needed: list[int], window: Window = None) -> None:
        """A statement answered: its window covers the steps before ``covered``, asks for ``needed``, and
        opens ``window``'s chunks."""
        with self._lock:
            self._notes.append((covered, list(needed), window))

    def take(self) -> Notes:
        """Every note since the last call."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes


def exchange(notes: Notes | None, device: torch.device) -> Notes:
    """Collective: rank 0's notes (``notes``; None on the other ranks) to every rank. One 8-byte
    broadcast a record, and a second only when there is something to say."""
    flat: list[int] = []
    for covered, needed, window in notes or []:
        flat += [covered, len(needed), *needed]
        flat += [0] if window is None else [1, window[0], window[1], window[2], len(window[3]), *window[3]]
    size = torch.tensor([len(flat)], dtype=torch.int64, device=device)  # nccl sends device tensors
    dist.broadcast(size, src=0)
    length = int(size.item())
    if not length:
        return []
    payload = torch.tensor(flat, dtype=torch.int64, device=device) if notes is not None \
        else torch.empty(length, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    values = payload.cpu().tolist()
    out: Notes = []
    i = 0
    while i < len(values):
        covered, k = values[i], values[i + 1]
        needed = values[i + 2:i + 2 + k]
        i += 2 + k
        window = None
        if values[i]:
            size, first, last, c = values[i + 1:i + 5]
            window = (size, first, last, values[i + 5:i + 5 + c])
            i += 5 + c
        else:
            i += 1
        out.append((covered, needed, window))
    return out


# per state of a window: a rank's opened chunks [k_r, c], their local paths one after the other, and each one's length
Pieces = list[tuple[np.ndarray, np.ndarray, list[int]]]


def own_openings(chunks: list[int], rank: int, layout: ChunkLayout,
                 states: list[tuple[torch.Tensor, ChunkTree | TensorTrees]]) -> Pieces:
    """A rank's part of a window's openings: of each state (its chunk-aligned buffer and its subtree, or
    its pieces' BLAKE3 trees), the opened chunks that fall among the rank's own (``layout`` is its own,
    of ``layout.size`` chunks), with their paths within its subtree (or up to the piece's digest). Rank 0
    puts the ranks' parts together (``witness.distributed``)."""
    lo = rank * layout.size
    local = [c - lo for c in chunks if lo <= c < lo + layout.size]
    out = []
    for flat, tree in states:
        raw = flat.numpy().reshape(layout.size, layout.chunk_bytes)
        paths = [tree.paths([c]) if isinstance(tree, ChunkTree) else tree.path(c) for c in local]
        out.append((raw[local].copy(), np.concatenate(paths) if paths else np.zeros((0, 32), np.uint8),
                    [len(p) for p in paths]))
    return out


def all_digests(digests: dict[str, str], device: torch.device, world: int, rank: int) -> list[dict[str, str]] | None:
    """Collective: every rank's digests of its pieces (the same names on every rank) to every rank in
    fixed-size rows; rank 0 gets them all, in rank order (None on the other ranks)."""
    names = sorted(digests)
    mine = torch.frombuffer(bytearray(b"".join(bytes.fromhex(digests[n]) for n in names)), dtype=torch.uint8)
    mine = mine.to(device)  # nccl sends device tensors
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    if rank != 0:
        return None
    size = len(mine) // len(names)
    table = [bytes(r.cpu().numpy()) for r in rows]  # one copy to the host per rank, then slices
    return [{n: t[i * size:(i + 1) * size].hex() for i, n in enumerate(names)} for t in table]


class ShareRing:
    """A rank's ring of its shares of recent states (every rank but 0, which holds the beacon's link).

    It keeps what rank 0's ring keeps, told by rank 0's notes: the share of each new state until a
    statement covers it, written to the bundle where a statement asks for the state. Writes run on
    a thread of their own; a state being written counts against the ring until it is written."""

    def __init__(self, out: str | Path, rank: int, capacity: int, steps: int, layout: ChunkLayout | None = None,
                 tree: bool = False, hashed_by: str = "host"):
        """``layout``: a chunked run's layout of this rank's rows of the parameters (``ChunkLayout.shard``);
        ``tree``: its chunks open into the state hash (each piece's BLAKE3 tree), not a subtree of their own;
        ``hashed_by``: "cuda" hashes the pieces where they lie (the Triton kernels), the ring's copy then
        giving a path's bytes."""
        self.out, self.rank, self.capacity, self.steps, self.layout = Path(out), rank, capacity, steps, layout
        self.tree, self.hashed_by = tree, hashed_by
        self.ring: dict[int, dict[str, torch.Tensor]] = {}
        self.trees: dict[int, ChunkTree | TensorTrees] = {}  # a chunked run: each kept state's subtree (or trees)
        self.covered = 0
        self.missing: set[int] = set()  # states asked for that this rank did not hold
        self._done: set[int] = set()  # states written
        self._pool = StatePool(layout)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="witness-share")
        self._writes: deque[tuple[Future, dict[str, torch.Tensor] | None]] = deque()  # (write, slot to free after)
        self.copies = self.written = self.bytes_written = self.peak_ring = 0
        self.copy_seconds = self.write_seconds = self.wait_seconds = self.tree_seconds = 0.0

    def answer(self, notes: Notes) -> dict[int, Pieces]:
        """Rank 0's notes: write this rank's share of each state asked for, free each covered one; and
        this rank's part of each window's openings, by the head size the window closes at."""
        opened: dict[int, Pieces] = {}
        for covered, needed, window in notes:
            if window is not None and self.layout is not None:
                size, first, last, chunks = window
                lost = [n for n in range(first, last + 1) if n not in self.ring]
                if lost:
                    raise RuntimeError(f"rank {self.rank} no longer holds the state after {lost[0]} update(s), whose "
                                       "chunks a window opens")
                opened[size] = own_openings(chunks, self.rank, self.layout, [
                    (self._pool.flat(self.ring[n]), self.trees[n]) for n in range(first, last + 1)])
            for n in needed:
                if n in self._done:
                    continue
                slot = self.ring.get(n)
                if slot is None:
                    self.missing.add(n)
                    continue
                self._done.add(n)
                self._writes.append((self._writer.submit(self._write, n, slot), None))
            for n in [n for n in self.ring if n < covered]:
                self._release_after_writes(self.ring.pop(n))
                self.trees.pop(n, None)
            self.covered = max(self.covered, covered)
        return opened

    def _release_after_writes(self, slot: dict[str, torch.Tensor]) -> None:
        """Free a slot once every write queued so far is done (one of them may read it)."""
        if self._writes:
            self._writes.append((self._writes[-1][0], slot))
        else:
            self._pool.release(slot)

    def _write(self, n: int, slot: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        path = self.out / online_shard_name(n, self.rank)
        write_state(path, slot, n)
        self.written += 1
        self.bytes_written += path.stat().st_size
        self.write_seconds += time.perf_counter() - started

    def _drain(self, wait: bool = False) -> None:
        """Free the slots whose writes are done (all of them, waiting, with ``wait``)."""
        while self._writes and (wait or self._writes[0][0].done()):
            future, slot = self._writes.popleft()
            future.result()  # a write that failed fails the run here
            if slot is not None:
                self._pool.release(slot)

    def keep(self, n: int, pieces: dict[str, torch.Tensor]) -> ChunkTree | TensorTrees | None:
        """This rank's share of the state after ``n`` updates, copied into the ring (unless a
        statement covers it already, or no step starts from it and no window opens it); in a
        chunked run, the subtree of its chunks (hashed in the ring's buffer)."""
        self._drain()
        if n < self.covered or n > self.steps or n == self.steps and self.layout is None:
            return self._tree(pieces) if self.layout is not None else None
        while self._writes and len(self.ring) + len(self._writes) >= self.capacity:
            started = time.perf_counter()
            self._writes[0][0].result()
            self.wait_seconds += time.perf_counter() - started
            self._drain()
        started = time.perf_counter()
        self.ring[n] = slot = self._pool.copy(pieces)
        self.copy_seconds += time.perf_counter() - started
        self.copies += 1
        self.peak_ring = max(self.peak_ring, len(self.ring))
        if self.layout is None:
            return None
        started = time.perf_counter()
        flat = self._pool.flat(slot)
        if not self.tree:
            tree = self.layout.tree(flat)  # type: ignore[arg-type]
        elif self.hashed_by == "cuda":  # the live pieces, where they lie
            tree = TensorTrees(pieces, self.layout, flat, "cuda")
        else:
            tree = TensorTrees(slot, self.layout, flat, plan=self._pool.plan(slot, "blake3"))
        self.trees[n] = tree
        self.tree_seconds += time.perf_counter() - started
        return tree

    def _tree(self, pieces: dict[str, torch.Tensor]) -> ChunkTree | TensorTrees:
        """The subtree (or the pieces' trees) of a state the ring does not keep."""
        assert self.layout is not None
        return TensorTrees(pieces, self.layout) if self.tree else self.layout.tree(self.layout.flatten(pieces))

    def finish(self) -> None:
        """After the last notes: every write done, every state asked for written."""
        self._drain(wait=True)
        self._writer.shutdown()
        if self.missing:
            raise RuntimeError(f"rank {self.rank} holds no share of the states {sorted(self.missing)[:10]} that "
                               "statements asked for")

    def close(self) -> None:
        """Stop the writer (after a failure)."""
        self._writer.shutdown(wait=False, cancel_futures=True)

    def report(self) -> dict:
        """What keeping this rank's shares cost it."""
        return {"copies": self.copies, "copy_seconds": self.copy_seconds, "written": self.written,
                "bytes_written": self.bytes_written, "write_seconds": self.write_seconds,
                "wait_seconds": self.wait_seconds, "peak_ring": self.peak_ring, "tree_seconds": self.tree_seconds}


class ShardChunks:
    """A chunked run over several ranks: each rank's rows of the parameters are a whole subtree of the
    chunk tree (``ChunkLayout.of_shards``), which that rank hashes in its ring's buffer. Every record,
    the ranks' subtree roots (32 bytes each) meet on rank 0, which makes the ``param_root``; and for each
    window, each rank's opened chunks and their paths within its subtree meet on rank 0, which adds the
    path above the subtree (from the subtree roots it kept) and writes the window's openings in the
    format one process writes (``docs/format.md``). Methods that say "collective" run on every rank."""

    def __init__(self, layout: ChunkLayout, rank: int, world: int, device: torch.device, k: int,
                 digest: str | None = None):
        """``digest``: where the chunks open into the state hash (version 4), the run's state digest
        (``blake3/W``); None: into a ``param_root`` of their own (version 3)."""
        self.layout, self.rank, self.world, self.device, self.k = layout, rank, world, device, k
        self.digest = digest
        self.mine = layout.shard(rank)
        self.subroots: dict[int, list[bytes]] = {}  # rank 0: every rank's subtree root of each state
        self.states: dict[int, ShardedState] = {}  # rank 0, version 4: each kept state's tree of the ranks' digests
        self.own: dict[int, Pieces] = {}  # rank 0: its part of each window's openings, by head size
        self._lock = threading.Lock()

    def opened_here(self, statement, first: int, states: list[tuple[torch.Tensor, ChunkTree]]) -> Window:  # noqa: ANN001
        """Rank 0 (its beacon thread): a window's statement answered; keep rank 0's part of its openings,
        and say what it opens (for the notes the other ranks get)."""
        chunks = self.layout.select(statement.beta, self.k)
        with self._lock:
            self.own[statement.size] = own_openings(chunks, 0, self.mine, states)
        return statement.size, first, first + len(states) - 1, chunks

    def param_root(self, n: int, tree: ChunkTree) -> bytes | None:
        """Collective: the ``param_root`` of the state after ``n`` updates, on rank 0, from every rank's subtree."""
        from ..commit.chunks import wrap_root

        mine = torch.frombuffer(bytearray(tree.levels[-1].tobytes()), dtype=torch.uint8).to(self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        if self.rank != 0:
            return None
        subroots = [bytes(r.cpu().numpy()) for r in rows]
        self.subroots[n] = subroots
        return wrap_root(self.layout.id, self.layout.size, self._above(subroots).levels[-1].tobytes())

    def state_tree(self, n: int, trees: TensorTrees, meta: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                   ) -> ShardedState | None:
        """Collective (version 4): the state tree of the state after ``n`` updates, on rank 0, from every
        rank's digests of its pieces (``trees``: this rank's, hashed once in its ring's copy); ``meta``
        each tensor's dtype and whole shape."""
        ranks = all_digests(trees.hex, self.device, self.world, self.rank)
        if ranks is None:
            return None
        self.states[n] = state = ShardedState(meta, ranks, self.digest)  # type: ignore[arg-type]
        return state

    @staticmethod
    def _above(subroots: list[bytes]) -> ChunkTree:
        """The tree over the ranks' subtree roots (the top of the chunk tree; its own root is not wrapped)."""
        return ChunkTree(b"".join(subroots), b"")

    def gather(self, notes: Notes, opened: dict[int, Pieces], write) -> None:  # noqa: ANN001 - write(size, first, chunks, pieces)
        """Collective, where a note opens a window: the ranks' parts of its openings to rank 0, which
        writes them with their whole paths (``write``: ``KeptFiles._write_openings``)."""
        if not any(window is not None for _, _, window in notes):
            return
        parts: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(opened, parts, dst=0)
        if parts is None:
            return
        for covered, _, window in notes:
            if window is None:
                continue
            size, first, last, chunks = window
            with self._lock:
                parts[0] = {size: self.own.pop(size)}
            ranks = [c // self.mine.size for c in chunks]
            pieces = []
            for i, n in enumerate(range(first, last + 1)):
                # what follows each rank's local path: the path above its subtree (version 3), or the tensor's
                # shard digests and audit path in the state tree (version 4)
                state = self.states[n] if self.digest else None
                above = self._above(self.subroots[n]) if state is None else None
                seen = [0] * self.world  # each rank's chunks come in ascending order, as ``chunks`` lists them
                data, paths = [], []
                for c, r in zip(chunks, ranks, strict=True):
                    part_data, part_paths, lengths = parts[r][size][i]
                    j = seen[r]
                    seen[r] += 1
                    data.append(part_data[j])
                    at = sum(lengths[:j])
                    tail = above.paths([r]) if above is not None else \
                        state.tail(self.layout.tensors[int(self.layout.tensor_of(np.asarray(c)))][0])  # type: ignore[union-attr]
                    paths += [part_paths[at:at + lengths[j]], tail]
                pieces.append((np.stack(data), np.concatenate(paths)))
            write(size, first, chunks, pieces)
            for held in (self.subroots, self.states):
                for n in [n for n in held if n < covered]:
                    del held[n]
