"""The trainer's side of online challenges: a ring of recent states, answered as statements arrive.

Every state the run commits is copied to the host into a ring as soon as its record is written.
The recorder streams a signed head every ``every`` steps; a background thread sends it to the
beacon, whose statement selects some steps of the window the head covers. For each selected step
the state before it and its batch's samples are written into the bundle (``online/``); the rest of
the window's states are freed. Training waits on the beacon only when the ring is full, and those
waits are counted.

A chunked run (``OnlineSpec.chunks``, on by default where the optimizer bounds a step's move) keeps
each state's parameters chunk-aligned in the ring's buffer and hashes them there into the chunk tree
whose root the step's record commits; each statement's beta then opens ``chunks`` chunks of every
state the window's steps go from and to, written with their paths (``online/chunks/``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..bundle.layout import (
    COSIGNED,
    MAX_JOURNAL_BYTES,
    STATEMENTS,
    online_chunks_name,
    online_samples_name,
)
from ..bundle.opened import TREE, StateTree, TensorTrees
from ..bundle.writer import read_lines
from ..commit.beacon import BeaconStatement, selected_steps
from ..commit.chunks import ChunkTree
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead
from ..data.dataset import Dataset
from ..fingerprint.chunks import ChunkLayout
from .kept import KeptFiles, StatePool
from .link import (
    DEFAULT_BAD_FRACTION,
    DEFAULT_CHUNKS,
    DEFAULT_CONFIDENCE,
    DEFAULT_EVERY,
    DRAND_EVERY,
    DRAND_RING,
    BeaconLink,
    OnlineSpec,
)

# the settings and the buffers, importable from here as before
__all__ = ["DEFAULT_BAD_FRACTION", "DEFAULT_CHUNKS", "DEFAULT_CONFIDENCE", "DEFAULT_EVERY", "DRAND_EVERY", "DRAND_RING",
           "BeaconLink", "OnlineChallenges", "OnlineSpec", "StatePool"]


class OnlineChallenges(KeptFiles):
    """The ring, the beacon's statements and the selected states of one run (in its bundle folder).

    The training thread copies states into the ring and builds each head's request; one background
    thread sends the requests in order and, as each statement arrives, writes the states it selects
    and frees the rest of its window. A lock guards the ring and the bookkeeping they share.
    """

    def __init__(self, out: Path, spec: OnlineSpec, link: BeaconLink, log: RunLog, steps: int, dataset: Dataset,
                 checkpoint_every: int, layout: ChunkLayout | None = None):
        if (layout is not None) != bool(spec.chunks) or layout is not None and layout.chunk_bytes != spec.chunk_bytes:
            raise ValueError("a chunked run's ring needs the layout of its parameters' chunks, and only such a run's")
        super().__init__(out, link, log, dataset, layout)
        self.tree_openings = bool(spec.tree)
        self.spec, self.steps, self.checkpoint_every = spec, steps, checkpoint_every
        self.ring: dict[int, dict[str, torch.Tensor]] = {}  # state after n updates, for steps not yet covered
        # the chunk tree of each state in the ring (a chunked run): its state tree, where the chunks open into
        # the state hash (spec.tree), which the record then commits instead of hashing the state again
        self.trees: dict[int, ChunkTree | StateTree | TensorTrees] = {}
        # windows stamped before a crash whose openings were lost: head size -> (first state, chunks, pieces
        # of the states passed again so far)
        self.reopen: dict[int, tuple[int, list[int], dict[int, tuple[np.ndarray, np.ndarray]]]] = {}
        self._scratch: torch.Tensor | None = None  # a flat buffer for a state the ring does not keep
        self._scratch_lock = threading.Lock()
        self._reopen_lock = threading.Lock()
        self.statements: dict[int, BeaconStatement] = {}  # by head size
        self.wanted: set[int] = set()  # states of selected steps still to come (after a resume)
        self.covered = 0  # steps 0 .. covered - 1 are in a statement's window
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="witness-beacon")  # one: heads go out in order
        self._settler: ThreadPoolExecutor | None = None  # witnessed windows: waits for drand rounds
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()
        self._buffers = StatePool(layout)
        self.waits, self.wait_seconds, self.rebuilt = 0, 0.0, 0
        # a chunked run: chunk trees hashed (and their time, wherever the hash ran)
        self.trees_built, self.tree_seconds, self.tree_cpu_seconds = 0, 0.0, 0.0
        self.peak_ring = 0
        self.copies = self.shared = 0  # states copied into the ring, and states the overlapped hash copied there
        self.copy_seconds = 0.0  # copies on the training thread
        # the link's own cost: building each head's request (training thread), sending it (the sending
        # thread's CPU) and, witnessed, fetching and checking the window's round (the settling thread's CPU)
        self.heads, self.body_seconds, self.post_cpu_seconds, self.settle_cpu_seconds = 0, 0.0, 0.0, 0.0
        self.settle_latency = 0.0  # seconds from each head's send to its settled window, summed (witnessed)
        # a run over several ranks: told, once a statement is answered here, what the window covers, which
        # states it asks for (the other ranks write their shares of those and free the rest) and, chunked,
        # what ``on_opening`` said of the window's states (rank 0's pieces of its openings: the ranks'
        # pieces meet on rank 0, which writes the window's openings; witness.distributed)
        self.on_answer: Callable[[int, list[int], object], None] | None = None
        self.on_opening: Callable[[BeaconStatement, int, list[tuple[torch.Tensor, ChunkTree]]], object] | None = None

    # --- statements -----------------------------------------------------------------------
    def load(self) -> None:
        """The statements already received (a resume): the file's intact lines, then the beacon's own list."""
        path, kept = self.out / STATEMENTS, []
        for line in read_lines(path) if path.exists() else []:
            try:
                st = self.link.check(parse_canonical_json(line), self.log)
            except Exception:  # noqa: BLE001 - a line torn by the crash ends what was kept
                break
            kept.append(line)
            self.statements[st.size] = st
        intact = b"".join(line + b"\n" for line in kept)
        if path.exists() and path.read_bytes() != intact:  # a line the crash tore: later ones start clean
            path.write_bytes(intact)
        for st in self.link.statements(self.log):
            if st.size not in self.statements:
                self._save(st)
        self._settle_journal()
        for st in sorted(self.statements.values(), key=lambda s: s.size):
            self.covered = max(self.covered, st.window(self.steps).stop)
            self.wanted |= {n for n in self._needed(st) if not self.state_path(n).exists()}
            win = st.window(self.steps)
            if self.layout is not None and len(win) and not (self.out / online_chunks_name(st.size)).exists():
                self.reopen[st.size] = (win.start, self._chunks_of(st), {})  # its states are passed again
        for t in sorted(self.selected):
            if not (self.out / online_samples_name(t)).exists():
                self._write_samples(t)

    def _settle_journal(self) -> None:
        """A resumed witnessed run: settle the checkpoints the witnesses cosigned before the crash whose
        windows were not kept yet (their rounds have come, or are waited for), then go on from the last."""
        settle = getattr(self.link, "settle", None)
        if settle is None:
            return
        from ..beacon.windows import PendingWindow

        path = self.out / COSIGNED
        for line in read_lines(path, MAX_JOURNAL_BYTES) if path.exists() else []:
            try:
                pending = PendingWindow.from_json(parse_canonical_json(line))
            except ValueError:
                break  # a line the crash tore
            if pending.size not in self.statements:
                self._save(settle(pending, self.log))
        self.link.resume_at(max(self.statements, default=0))  # type: ignore[attr-defined]

    def settled(self, final: int) -> bool:
        """Whether the audit of a run whose end record its head of size ``final`` signs is whole (after ``load``):
        that head answered, no selected state or window's openings owed, no cosigned checkpoint journaled."""
        return final in self.statements and not self.wanted and not self.reopen and not (self.out / COSIGNED).exists()

    def _needed(self, st: BeaconStatement) -> set[int]:
        """The states a statement asks for: before each selected step, and after it (what a verifier in
        tolerance mode compares with), unless that is a checkpoint the bundle holds anyway."""
        out = set()
        for t in selected_steps(st, self.spec.p, self.steps):
            self.selected.add(t)
            out.add(t)
            if t + 1 < self.steps and (t + 1) % self.checkpoint_every:
                out.add(t + 1)
        return out

    def _save(self, st: BeaconStatement) -> None:
        self.statements[st.size] = st
        path = self.out / STATEMENTS
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(canonical_json(st.to_json()) + b"\n")

    def first_needed(self) -> int:
        """The earliest state a resumed run must pass again (a selected one lost, a window's first, the first uncovered)."""
        return min([self.covered, *self.wanted, *(first for first, _, _ in self.reopen.values())])

    def _chunks_of(self, st: BeaconStatement) -> list[int]:
        """The chunks a statement's beta opens."""
        assert self.layout is not None
        return self.layout.select(st.beta, self.spec.chunks)

    # --- the ring (training thread) ---------------------------------------------------------
    def keep(self, n: int, state: dict[str, torch.Tensor]) -> ChunkTree | StateTree | TensorTrees | None:
        """The committed state after ``n`` updates (the state before step ``n``): copied into the ring;
        in a chunked run, its chunk tree (whose root the record commits), or its state tree."""
        slot = None
        if self._admit(n, state):
            started = time.perf_counter()
            with self._lock:
                slot = self._buffers.copy(state)
                self._hold(n, slot)
            self.copy_seconds += time.perf_counter() - started
            self.copies += 1
        # hashed on the GPU (hashed_by "cuda"): the live state where it lies, the ring's copy for the paths' bytes
        on_device = bool(self.spec.tree) and self.spec.hashed_by == "cuda"
        kept = slot if slot is not None else state
        return self.tree(n, kept, state) if on_device else self.tree(n, kept)

    def tree(self, n: int, tensors: dict[str, torch.Tensor],
             source: dict[str, torch.Tensor] | None = None) -> ChunkTree | StateTree | TensorTrees | None:
        """The chunk tree of the state after ``n`` updates (None: the run commits no chunks), hashed in
        its ring buffer where the ring holds it (any thread: the overlapped hash calls it with the copy).
        Where the chunks open into the state hash (``spec.tree``), the whole state's tree, in one pass
        (``source``: the same state on the GPU, hashed there by the Triton kernels)."""
        if self.layout is None:
            return None
        started, cpu = time.perf_counter(), time.thread_time()
        flat = self._buffers.flat(tensors)
        with contextlib.nullcontext() if flat is not None else self._scratch_lock:
            if flat is None:  # a state the ring does not keep: laid out in the scratch buffer
                if self._scratch is None:
                    self._scratch = self.layout.empty()
                flat = self.layout.flatten(tensors, self._scratch)
            if not self.spec.tree:
                tree = self.layout.tree(flat)
            elif self.shard is not None:  # rank 0's share over several ranks (witness.distributed makes the state's)
                tree = TensorTrees(tensors, self.layout, flat, plan=self._buffers.plan(tensors, TREE)) \
                    if source is None else TensorTrees(source, self.layout, flat, "cuda")
            else:  # one process (BLAKE3 of whole tensors: check_tree_settings), on the GPU where the state lies
                tree = StateTree(tensors, TREE, self.layout, flat, plan=self._buffers.plan(tensors, TREE)) \
                    if source is None else StateTree(source, TREE, self.layout, flat, "cuda")
            if self.reopen:
                self._collect(n, flat, tree)
        with self._lock:
            if self.ring.get(n) is tensors:
                self.trees[n] = tree
        self.trees_built += 1
        self.tree_seconds += time.perf_counter() - started
        self.tree_cpu_seconds += time.thread_time() - cpu
        return tree

    def _collect(self, n: int, flat: torch.Tensor, tree: ChunkTree) -> None:
        """A resumed run passing state ``n`` again: its pieces of the windows whose openings were lost,
        and each such window's file once all its states are here (one thread at a time: the overlapped
        hash's thread and the training thread may both pass states)."""
        with self._reopen_lock:
            for size, (first, chunks, pieces) in list(self.reopen.items()):
                last = first + len(self._window_at(size))
                if first <= n <= last and n not in pieces:
                    pieces[n] = self._pieces(flat, tree, chunks)
                    if len(pieces) == last - first + 1:
                        del self.reopen[size]
                        self._write_openings(size, first, chunks, [pieces[m] for m in range(first, last + 1)])

    def _window_at(self, size: int) -> range:
        return self.statements[size].window(self.steps)

    def state_hash(self, n: int, digest: str) -> bytes | None:
        """The state after ``n`` updates hashed in the ring's copy (``SlotPlan``), None if it holds none."""
        with self._lock:
            slot = self.ring.get(n)
            plan = self._buffers.plan(slot, digest) if slot is not None else None
        return plan.state_hash() if plan is not None else None

    def reserve(self, n: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A ring buffer for the state after ``n`` updates that the caller fills (the overlapped state
        hash copies into it, so the state is copied once for both), or None if it is not kept."""
        if not self._admit(n, state):
            return None
        with self._lock:
            slot = self._buffers.take(state)
            self._hold(n, slot)
        self.shared += 1
        return slot

    def _admit(self, n: int, state: dict[str, torch.Tensor]) -> bool:
        """Whether the state after ``n`` updates goes into the ring, once it has room (a state the
        crash lost is written at once instead, and a covered one is not kept)."""
        self.drain()
        with self._lock:
            rebuild = n in self.wanted
        if rebuild:  # selected before a crash lost it: rebuilt from the checkpoint before it
            self._write(n, state)
            with self._lock:
                self.wanted.discard(n)
            self.rebuilt += 1
        with self._lock:
            # covered by a statement (and not selected, or written just now), or the final state, which no step
            # starts from (but a chunked run's last window opens its chunks). A state the window before ends on
            # is the next window's first: kept, though a crash made it be written already
            if n < self.covered or n > self.steps or n == self.steps and self.layout is None:
                return False
        while len(self.ring) >= self.spec.ring:
            if not self._pending:
                raise RuntimeError(f"the ring of {self.spec.ring} states is full and no head is out to the beacon")
            started = time.perf_counter()
            self._pending[0].result()
            self.waits += 1
            self.wait_seconds += time.perf_counter() - started
            self.drain()
        return True

    def _hold(self, n: int, slot: dict[str, torch.Tensor]) -> None:
        self.ring[n] = slot
        self.peak_ring = max(self.peak_ring, len(self.ring))

    def send(self, head: SignedTreeHead) -> None:
        """Stream a signed head to the beacon in the background (its request is built here, in order)."""
        if head.size <= max(self.statements, default=0):
            return  # stamped already (a resumed run passing its old heads again)
        settle = getattr(self.link, "settle", None)
        if settle is not None and head.size < 2:
            return  # the manifest's head closes no window (it covers no step)
        started = time.perf_counter()
        body = self.link.body(head, self.log)
        self.body_seconds += time.perf_counter() - started
        self.heads += 1
        if settle is None:
            self._pending.append(self._worker.submit(self._stamp, body, head))
            return
        # witnessed windows: the checkpoint goes to the witnesses at once, in order, and a second
        # thread waits for the window's drand round (a wait must never hold up the next checkpoint)
        posted = self._worker.submit(self._post, body, head)
        if self._settler is None:
            self._settler = ThreadPoolExecutor(1, thread_name_prefix="witness-drand")
        self._pending.append(self._settler.submit(self._settle, settle, posted, started))

    def drain(self) -> None:
        """Forget the requests that are answered (raises what the beacon or a write raised)."""
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()

    # --- the background thread ----------------------------------------------------------------
    def _stamp(self, body: dict, head: SignedTreeHead) -> None:
        self._stamped(self._post(body, head))

    def _post(self, body: dict, head: SignedTreeHead) -> object:
        cpu = time.thread_time()
        try:
            posted = self.link.post(body, head, self.log)
            if getattr(self.link, "settle", None) is not None:
                self._journal(posted)
            return posted
        finally:
            self.post_cpu_seconds += time.thread_time() - cpu

    def _journal(self, pending) -> None:  # noqa: ANN001 - the link's pending window
        """Keep a cosigned checkpoint until its window settles: the witnesses keep only their latest
        checkpoint, so one lost with the process could not be asked for again."""
        path = self.out / COSIGNED
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(canonical_json(pending.to_json()) + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def _settle(self, settle, posted: Future, sent: float) -> None:  # noqa: ANN001 - the link's settle
        pending = posted.result()
        cpu = time.thread_time()
        try:
            window = settle(pending, self.log)
        finally:
            self.settle_cpu_seconds += time.thread_time() - cpu
        self.settle_latency += time.perf_counter() - sent
        self._stamped(window)

    def _stamped(self, st: BeaconStatement) -> None:
        """A statement (or a settled window) received: keep it, write what it selects (and, chunked, the
        chunks it opens of every state of its window), free the rest."""
        win = st.window(self.steps)
        with self._lock:
            if st.size in self.statements:
                return
            self._save(st)
            before = set(self.selected)
            needed = self._needed(st)
            fresh = sorted(self.selected - before)
            covered = max(self.covered, win.stop)
            # the window's states, read outside the lock: training never writes into a held buffer, and
            # the state the window ends on stays in the ring (the next window's steps go from it)
            opening = None
            if self.layout is not None and len(win):
                states = range(win.start, win.stop + 1)
                if all(n in self.ring and n in self.trees for n in states):
                    opening = [(self._buffers.flat(self.ring[n]), self.trees[n]) for n in states]
                else:  # a resumed run whose ring lost some: they are passed again (first_needed)
                    self.reopen[st.size] = (win.start, self._chunks_of(st), {})
            write, free = [], []
            for n in sorted(needed):
                if n in self.ring:
                    write.append((n, self.ring[n]))
                elif not self.state_path(n).exists():
                    self.wanted.add(n)
            self.covered = covered
        window = None
        if opening is not None and self.on_opening is not None:
            window = self.on_opening(st, win.start, opening)  # type: ignore[arg-type]
        elif opening is not None:
            self._write_openings(st.size, win.start, c := self._chunks_of(st), self._window_pieces(opening, c))
        if self.on_answer is not None:
            self.on_answer(covered, sorted(needed), window)
        # covered states leave the ring once the note is out: other ranks free theirs by rank 0's notes
        with self._lock:
            for n in [n for n in self.ring if n < covered]:
                free.append(self.ring.pop(n))
                self.trees.pop(n, None)
        for t in fresh:  # the samples need no state: written outside the lock, like the states
            self._write_samples(t)
        for n, slot in write:
            self._write(n, slot)
        with self._lock:
            for slot in free:
                self._buffers.release(slot)

    def wait(self) -> None:
        """Wait until every head sent so far is answered and what it selected is written (and passed
        to the link); raises what the beacon or a write raised."""
        while self._pending:
            self._pending.popleft().result()

    def finish(self) -> None:
        """Wait for every statement; every selected state must then be written."""
        self.wait()
        self._worker.shutdown()
        if self._settler is not None:
            self._settler.shutdown()
        # every cosigned checkpoint settled into a window (a resume may have settled the last ones itself)
        (self.out / COSIGNED).unlink(missing_ok=True)
        if self.wanted:
            raise RuntimeError(f"selected steps {sorted(self.wanted)[:10]} have no kept state: they were lost and "
                               "not passed again")
        if self.reopen:
            raise RuntimeError(f"the windows closing at sizes {sorted(self.reopen)[:10]} have no chunk openings: their "
                               "states were lost and not passed again")

    def close(self) -> None:
        """Stop the background thread (after a failure)."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._settler is not None:
            self._settler.shutdown(wait=False, cancel_futures=True)

    def report(self) -> dict:
        """What answering cost the trainer."""
        kept = ("written", "bytes_written", "rebuilt", "waits", "wait_seconds", "peak_ring", "copy_seconds", "write_seconds",
                "write_cpu_seconds", "publish_seconds", "copies", "heads", "body_seconds", "post_cpu_seconds",
                "settle_cpu_seconds", "tree_seconds", "tree_cpu_seconds", "opened", "opened_bytes")
        return {k: getattr(self, k) for k in kept} | {
            "statements": len(self.statements), "selected": len(self.selected), "shared_copies": self.shared,
            "trees": self.trees_built, "request_cpu_seconds": float(getattr(self.link, "request_cpu_seconds", 0.0)),
            "settle_latency_mean": self.settle_latency / self.heads if self.settle_latency else 0.0}
