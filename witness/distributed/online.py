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

import torch
import torch.distributed as dist

from ..bundle.checkpoint import write_state
from ..bundle.layout import online_shard_name
from ..record.kept import StatePool

Notes = list[tuple[int, list[int]]]  # (steps covered so far, the states a window asks for), in answer order


class Answers:
    """Rank 0's notes of the statements answered so far: taken by the beacon's thread, sent at each record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notes: Notes = []

    def note(self, covered: int, needed: list[int]) -> None:
        """A statement answered: its window covers the steps before ``covered`` and asks for ``needed``."""
        with self._lock:
            self._notes.append((covered, list(needed)))

    def take(self) -> Notes:
        """Every note since the last call."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes


def exchange(notes: Notes | None, device: torch.device) -> Notes:
    """Collective: rank 0's notes (``notes``; None on the other ranks) to every rank. One 8-byte
    broadcast a record, and a second only when there is something to say."""
    flat: list[int] = []
    for covered, needed in notes or []:
        flat += [covered, len(needed), *needed]
    size = torch.tensor([len(flat)], dtype=torch.int64, device=device)  # nccl sends device tensors
    dist.broadcast(size, src=0)
    length = int(size.item())
    if not length:
        return []
    payload = torch.tensor(flat, dtype=torch.int64, device=device) if notes is not None \
        else torch.empty(length, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    values = payload.cpu().tolist()
    out, i = [], 0
    while i < len(values):
        covered, k = values[i], values[i + 1]
        out.append((covered, values[i + 2:i + 2 + k]))
        i += 2 + k
    return out


class ShareRing:
    """A rank's ring of its shares of recent states (every rank but 0, which holds the beacon's link).

    It keeps what rank 0's ring keeps, told by rank 0's notes: the share of each new state until a
    statement covers it, written to the bundle where a statement asks for the state. Writes run on
    a thread of their own; a state being written counts against the ring until it is written."""

    def __init__(self, out: str | Path, rank: int, capacity: int, steps: int):
        self.out, self.rank, self.capacity, self.steps = Path(out), rank, capacity, steps
        self.ring: dict[int, dict[str, torch.Tensor]] = {}
        self.covered = 0
        self.missing: set[int] = set()  # states asked for that this rank did not hold
        self._done: set[int] = set()  # states written
        self._pool = StatePool()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="witness-share")
        self._writes: deque[tuple[Future, dict[str, torch.Tensor] | None]] = deque()  # (write, slot to free after)
        self.copies = self.written = self.bytes_written = self.peak_ring = 0
        self.copy_seconds = self.write_seconds = self.wait_seconds = 0.0

    def answer(self, notes: Notes) -> None:
        """Rank 0's notes: write this rank's share of each state asked for, free each covered one."""
        for covered, needed in notes:
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
            self.covered = max(self.covered, covered)

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

    def keep(self, n: int, pieces: dict[str, torch.Tensor]) -> None:
        """This rank's share of the state after ``n`` updates, copied into the ring (unless a
        statement covers it already, or no step starts from it)."""
        self._drain()
        if n < self.covered or n >= self.steps:
            return
        while self._writes and len(self.ring) + len(self._writes) >= self.capacity:
            started = time.perf_counter()
            self._writes[0][0].result()
            self.wait_seconds += time.perf_counter() - started
            self._drain()
        started = time.perf_counter()
        self.ring[n] = self._pool.copy(pieces)
        self.copy_seconds += time.perf_counter() - started
        self.copies += 1
        self.peak_ring = max(self.peak_ring, len(self.ring))

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
                "wait_seconds": self.wait_seconds, "peak_ring": self.peak_ring}
