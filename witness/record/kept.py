"""What an online run keeps: host buffers for its ring of states, and the files its statements select.

``StatePool`` holds the ring's host copies; ``KeptFiles`` writes into the bundle's ``online/``
folder the state before (and after) each selected step, the step's batch samples, and a chunked
window's openings, passing each file to the link once written (a leaderboard replays the step while
the run trains), and counts what that cost. ``OnlineChallenges`` (``witness.record.online``) is one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..bundle.checkpoint import write_state
from ..bundle.layout import (
    online_chunks_name,
    online_samples_name,
    online_shard_name,
    online_state_name,
)
from ..bundle.opened import SlotPlan, StateTree, window_paths
from ..bundle.openings import WindowOpenings, write_openings
from ..commit.chunks import ChunkTree
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.log import RunLog
from ..data.dataset import Dataset
from ..fingerprint.chunks import ChunkLayout
from .link import BeaconLink


class StatePool:
    """Host buffers for states, reused: a copy into one is one ``_foreach_copy_`` with no allocation.

    A state's names and shapes are fixed within a run once the optimizer has stepped (the initial
    state has no moments yet), so a buffer is reused for any state with its names; what costs is
    the per-tensor work, so nothing else is done per tensor on a copy."""

    def __init__(self, layout: ChunkLayout | None = None) -> None:
        self.free: list[dict[str, torch.Tensor]] = []
        self._targets: dict[int, list[torch.Tensor]] = {}  # id(slot) -> its tensors, in its order
        # a chunked run's slots hold their parameters in one chunk-aligned buffer (hashed in place)
        self.layout = layout
        self._flat: dict[int, torch.Tensor] = {}  # id(slot) -> that buffer
        self._plans: dict[int, SlotPlan] = {}  # id(slot) -> how it is hashed (its first hash works it out)

    def take(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A free buffer shaped like ``state`` (pinned host memory for a GPU state), not filled."""
        slot = self.free.pop() if self.free else None
        # a buffer serves a state of the same names, shapes and dtypes (a copy would cast or broadcast silently)
        if slot is None or slot.keys() != state.keys() or any(
                slot[k].shape != v.shape or slot[k].dtype != v.dtype for k, v in state.items()):
            if slot is not None:
                self._targets.pop(id(slot), None)
                self._flat.pop(id(slot), None)
                self._plans.pop(id(slot), None)
            pinned = any(v.is_cuda for v in state.values())
            views: dict[str, torch.Tensor] = {}
            flat = None
            if self.layout is not None and all(n in state for n in self.layout.names):
                flat = self.layout.empty(pinned)
                views = self.layout.views(flat)
            slot = {k: views[k] if k in views else torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pinned)
                    for k, v in state.items()}
            self._targets[id(slot)] = list(slot.values())
            if flat is not None:
                self._flat[id(slot)] = flat
        return slot

    def flat(self, slot: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The chunk-aligned buffer that holds a slot's parameters (None: not one of this pool's)."""
        return self._flat.get(id(slot))

    def plan(self, slot: dict[str, torch.Tensor], digest: str) -> SlotPlan | None:
        """How one of this pool's host slots is hashed with ``digest`` (None: not one of its slots)."""
        if id(slot) not in self._targets:
            return None
        plan = self._plans.get(id(slot))
        if plan is None or plan.digest != digest:
            plan = self._plans[id(slot)] = SlotPlan(slot, digest)
        return plan

    def copy(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A host copy of ``state`` that training cannot change."""
        slot = self.take(state)
        dst = self._targets[id(slot)]
        with torch.no_grad():  # copying from parameters: nothing to record for autograd
            foreach = getattr(torch, "_foreach_copy_", None)
            src = [state[k] for k in slot]
            if foreach is not None:
                foreach(dst, src, non_blocking=True)
            else:  # pragma: no cover - older torch
                for d, t in zip(dst, src, strict=True):
                    d.copy_(t, non_blocking=True)
            if any(t.is_cuda for t in src[:1]):
                torch.cuda.current_stream().synchronize()  # the copy must be whole before training goes on
        return slot

    def release(self, slot: dict[str, torch.Tensor]) -> None:
        """Give a buffer back once nothing reads it."""
        self.free.append(slot)


class KeptFiles:
    """Writes an online run's kept files into its bundle folder and counts their cost."""

    def __init__(self, out: Path, link: BeaconLink, log: RunLog, dataset: Dataset, layout: ChunkLayout | None):
        self.out, self.link, self.log, self.dataset, self.layout = out, link, log, dataset, layout
        self.shard: int | None = None  # the rank whose share of each state is kept (None: whole states)
        self.tree_openings = False  # the chunks open into the state hash: openings of version 2
        self.selected: set[int] = set()  # every step a statement selected (the states before them are passed on)
        self.written = self.bytes_written = 0  # states written, and every kept file's bytes
        # a chunked run: windows opened and their files' bytes (also in bytes_written)
        self.opened = self.opened_bytes = 0
        # writes and uploads (to a leaderboard), in the background
        self.write_seconds = self.write_cpu_seconds = self.publish_seconds = 0.0

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Count a write's time, and its own work apart from its waits on the disk."""
        started, cpu = time.perf_counter(), time.thread_time()
        yield
        self.write_seconds += time.perf_counter() - started
        self.write_cpu_seconds += time.thread_time() - cpu

    def _pieces(self, flat: torch.Tensor, tree: ChunkTree | StateTree,
                chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """One state's opened chunks ([k, chunk bytes], a copy) and their paths ([nodes, 32])."""
        assert self.layout is not None
        raw = flat.numpy().reshape(self.layout.size, self.layout.chunk_bytes)
        return raw[chunks].copy(), tree.paths(chunks)

    def _window_pieces(self, opening: list[tuple[torch.Tensor, ChunkTree | StateTree]],
                       chunks: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``_pieces`` of each of a window's states (``flat``, ``tree``): state trees' paths all at once."""
        trees = [tree for _, tree in opening]
        if not all(isinstance(t, StateTree) for t in trees):
            return [self._pieces(flat, tree, chunks) for flat, tree in opening]
        assert self.layout is not None
        rows = (self.layout.size, self.layout.chunk_bytes)
        return [(flat.numpy().reshape(rows)[chunks].copy(), paths)
                for (flat, _), paths in zip(opening, window_paths(trees, chunks), strict=True)]  # type: ignore[arg-type]

    def _write_openings(self, size: int, first: int, chunks: list[int],
                        pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Write a window's openings (and pass the file to the link, as the kept states are)."""
        path = self.out / online_chunks_name(size)
        with self._writing():
            tree = self.layout is not None and self.tree_openings
            opened = WindowOpenings(size, first, tuple(chunks), np.stack([c for c, _ in pieces]),
                                    (np.concatenate if tree else np.stack)([p for _, p in pieces]), 2 if tree else 1)
            written = write_openings(path, opened)
            self.opened += 1
            self.opened_bytes += written
            self.bytes_written += written
        self._publish("chunks", size, path)

    def _write_samples(self, t: int) -> None:
        """The samples of selected step ``t``, from its record's batch (written already) and the dataset."""
        path = self.out / online_samples_name(t)
        with self._writing():
            idx = parse_canonical_json(self.log.lines[t + 1])["batch"]
            doc = {"step": t, "indices": idx, "samples": [self.dataset.sample_bytes(i).hex() for i in idx]}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(canonical_json(doc))
            tmp.replace(path)
            self.bytes_written += path.stat().st_size
        self._publish("samples", t, path)

    def _publish(self, kind: str, step: int, path: Path) -> None:
        """Pass a kept file to the link, if it takes them (what it costs is the upload's time)."""
        publish = getattr(self.link, "publish", None)
        if publish is not None:
            started = time.perf_counter()
            publish(kind, step, path)
            self.publish_seconds += time.perf_counter() - started

    def state_path(self, n: int) -> Path:
        """Where the state after ``n`` updates is kept (a rank's share of it, in a run over several)."""
        return self.out / (online_state_name(n) if self.shard is None else online_shard_name(n, self.shard))

    def _write(self, n: int, state: dict[str, torch.Tensor]) -> None:
        """The state after ``n`` updates (this rank's share of it, in a run over several)."""
        path = self.state_path(n)
        with self._writing():
            write_state(path, state, n)
            self.written += 1
            self.bytes_written += path.stat().st_size
        if n in self.selected and self.shard is None:  # the state before a selected step (the one after it
            self._publish("states", n, path)            # serves tolerance mode); a share is not a state
