"""A run's records as its loop logs them: each step's record and the hash of the state after it
(off the training stream where it may be), the checkpoints, and the tree heads that sign them.

``Records`` is the base of ``witness.record.recorder.Recorder``, which adds how a run starts or
resumes and what a loop calls; a run's bundle, open for its next record, is an ``Opened``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..bundle.checkpoint import save_checkpoint
from ..bundle.layout import CHECKPOINTS, HEADS, LOG, checkpoint_name, checkpoint_step, due
from ..bundle.opened import StateLeaves
from ..bundle.state import state_hash, state_tensors
from ..bundle.writer import BundleWriter, head_sizes, truncate_lines
from ..commit.chunks import ChunkTree
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead
from ..fingerprint.moves import one_rate
from ..session import TrainingSession
from ..task.base import StepOutput, Task
from .loop import off_by_one_hint
from .mismatch import SelfCheckFailed
from .online import OnlineChallenges
from .options import HeadCallback
from .overlap import StateSnapshots
from .selfcheck import SelfCheck


@dataclass
class Opened:
    """A run's bundle, open for its next record: what starting or resuming a run hands the recorder."""

    task: Task
    out: Path
    session: TrainingSession
    writer: BundleWriter
    log: RunLog
    manifest: dict
    start_step: int  # the first step the loop trains here


def tree_fields(tree: ChunkTree | StateLeaves | bytes) -> dict:
    """What a chunked run's record commits of a state's tree: its ``param_root`` (version 3: a chunk tree,
    or its root over ranks), or the state hash and its leaves, where the chunks open into the state hash
    (version 4)."""
    if isinstance(tree, StateLeaves):
        return {"state_hash": tree.root.hex(), "state_leaves": tree.size}
    return {"param_root": (tree if isinstance(tree, bytes) else tree.root).hex()}


# the recorder's parts, as the closing line names them
PROBES = "the probes' forward (the fingerprint)"
SKETCH = "the parameter sketch"
HASH = "the hash of the whole state"
CHECKPOINT = "writing checkpoints"

class Records:
    """Appends a run's step records, commits the states they name, and signs the heads.

    A record commits the hash of the whole training state after its step every ``state_every``
    steps (default: every step), and a checkpoint file every ``checkpoint_every`` steps.
    """

    def __init__(self, key: Ed25519PrivateKey, opened: Opened, on_head: HeadCallback | None = None,
                 online: OnlineChallenges | None = None):
        self.task, self.out, self.key = opened.task, Path(opened.out), key
        self.session, self.writer, self.log, self.manifest = opened.session, opened.writer, opened.log, opened.manifest
        self.start_step = self.next_step = opened.start_step
        manifest = opened.manifest
        self.checkpoint_every = manifest["checkpoint_every"]
        self.state_every = manifest["state_every"]
        self.digest = manifest["state_digest"]
        self.on_head = on_head
        self._pending: tuple[int, list[int], bytes] | None = None
        # Off the training stream by default on a GPU, where the host is otherwise idle while the
        # device computes; on the CPU the hash thread would only compete with training's threads.
        self.overlap = self.session.device.type == "cuda"
        self._snapshots: StateSnapshots | None = None
        self._early: frozenset[str] = frozenset()  # buffers a forward changes: copied ahead of it
        self._deferred: tuple[dict, Any] | None = None  # a record waiting for its state hash
        self.online = online  # the beacon's statements and the ring of states they may select
        # a resumed run passes its signed records again from a checkpoint: each must come out the same
        self._signed = len(self.log) - 1
        self._old_heads: dict[int, SignedTreeHead] = {}
        self.self_check: SelfCheck | None = None  # replays a few steps as they are recorded (create's)
        # where the time goes: the loop's steps, and the recorder's work on their records
        self.step_seconds = self.record_seconds = 0.0
        # the recorder's parts that are measured on the loop's own time (a hash overlapped with training is not)
        self.part_seconds = {PROBES: 0.0, SKETCH: 0.0, HASH: 0.0, CHECKPOINT: 0.0}
        self._left: float | None = None
        self._aside = 0.0  # the recorder's own work between two records (the self-check's copy)

    @property
    def _rounds(self) -> bool:
        """Whether the records closing a window name its drand round (witnessed windows)."""
        return self.online is not None and hasattr(self.online.link, "next_round")

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained."""
        return self.session.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Its optimizer."""
        return self.session.optimizer

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The training state as the run commits it, from this process's own tensors (a DDP rank's
        replica: its wrapper's module)."""
        return state_tensors(getattr(self.session, "module", self.model), self.optimizer)

    def expect(self, step: int, indices: list[int], root: bytes) -> None:
        """Note the committed batch that the next ``log_step`` records."""
        if step != self.next_step:
            raise ValueError(f"expected step {self.next_step}, got {step}")
        self._pending = (step, indices, root)

    def checkpoint_due(self, step: int) -> bool:
        """Whether the state after ``step`` is a checkpoint."""
        return due(step, self.checkpoint_every, self.task.config.steps)

    def state_due(self, step: int) -> bool:
        """Whether the record of ``step`` commits the hash of the state after it."""
        return due(step, self.state_every, self.task.config.steps)

    def _within_recipe(self, step: int) -> None:
        if step >= self.task.config.steps:
            raise ValueError(f"step {step} is beyond the recipe: {off_by_one_hint(self.task.config.steps)}")

    def log_step(self, step: int, out: StepOutput, *, fingerprint: Any = None, sketch: list[float] | None = None,
                 state: dict | None = None, live: bool = False, state_root: bytes | Future | None = None,
                 tree: dict | None = None) -> None:
        """Append the record of ``step`` (call right after the optimizer stepped).

        A distributed run computes the fingerprint, sketch and (where a state is committed) the
        full state with collectives on every rank and hands them in; a single process lets the
        recorder do it. ``live`` says the handed-in state is the training's own tensors (which
        stay put until the optimizer steps again), not a copy: it may then be hashed off the
        training stream, like the state the recorder takes itself. An FSDP2 run over several ranks
        hands in the ``state_root`` its ranks computed from their shares instead (or a future of
        it, which it settles before the next record), never at a checkpoint; and a chunked online
        run over several ranks what its ranks' trees make (``tree``: the ``param_root`` of their chunk
        subtrees, or the state tree's ``state_leaves``, with its ``state_hash`` at a checkpoint).
        """
        self._within_recipe(step)
        entered = time.perf_counter()
        if self._left is not None:
            self.step_seconds += entered - self._left - self._aside  # the loop's own step, between two records
            self.record_seconds += self._aside
        self._aside = 0.0
        try:
            self._log_step(step, out, fingerprint, sketch, state, live, state_root, tree)
            if self.self_check is not None:  # the state just committed: the next step is replayed from it
                self.self_check.prepare(step + 1)
        finally:
            self._left = time.perf_counter()
            self.record_seconds += self._left - entered

    def _log_step(self, step: int, out: StepOutput, fingerprint: Any, sketch: list[float] | None,
                  state: dict | None, live: bool, state_root: bytes | Future | None, tree: dict | None) -> None:
        if self._pending is None or self._pending[0] != step:
            raise ValueError(f"log_step({step}) without batch({step}) first")
        _, idx, root = self._pending
        self._pending = None
        if self.self_check is not None:
            with self._unsigned_dropped_on_failure():
                self.self_check.finish(step, out)  # raises, before anything is signed, if the step does not replay
        if self.online is not None:
            self.online.drain()
            if self.online.spec.chunks:  # refused before it is signed, rather than by every verifier
                one_rate(self.optimizer, step, out.lr)
        began = time.perf_counter()
        fp = fingerprint if fingerprint is not None else self.session.fingerprint()
        self.part_seconds[PROBES] += time.perf_counter() - began
        record: dict[str, Any] = {
            "type": "step",
            "step": step,
            "batch": idx,
            "batch_root": root.hex(),
            "loss": out.loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            "fingerprint": fp.to_json(),
            "sketch": sketch if sketch is not None else self._timed(SKETCH, self.session.sketch),
        }
        record |= tree or {}
        done = step + 1
        checkpoint = self.checkpoint_due(step)
        self.flush()  # the previous record first: the log keeps step order
        if state_root is not None:
            if self.online is not None and self.online.shard is None:
                raise ValueError("online challenges need the whole state at every step, or each rank keeping its "
                                 "share (witness.distributed)")
            if not self.state_due(step) or checkpoint:
                raise ValueError("a state root comes with a committed state between checkpoints")
            if isinstance(state_root, Future):
                self._deferred = (record, state_root)
                self.next_step = done
                return
            if record.get("state_hash", state_root.hex()) != state_root.hex():
                raise RuntimeError(f"the state after step {step} hashed two ways")
            record["state_hash"] = state_root.hex()
        elif self.state_due(step):
            if state is None:
                state, live = state_tensors(self.model, self.optimizer), True
            # (a state the GPU hashes is hashed where it lies, before training goes on: not later, off the stream)
            later = live and self.overlap and not checkpoint and step >= self._signed and not (
                self.online is not None and self.online.spec.tree and self.online.spec.hashed_by == "cuda")
            if self.online is not None and self.online.shard is None and not later:
                # (a run over several ranks keeps each rank's share itself: witness.distributed)
                tree = self.online.keep(done, state)  # a host copy, before training changes it
                if tree is not None:  # the parameters' chunks, which the window's beta will open
                    record |= tree_fields(tree)
            if later:
                # the overlapped hash copies the state anyway: into the ring's buffer, when it keeps it
                self._hash_later(record, state, self.online.reserve(done, state) if self.online is not None else None,
                                 done)
                self.next_step = done
                return
            if checkpoint:
                sh, fh = self._timed(CHECKPOINT, save_checkpoint, self.out / checkpoint_name(done), state, done,
                                     self.digest)
                if record.get("state_hash", sh.hex()) != sh.hex():  # (the state tree hashed the same state)
                    raise RuntimeError(f"the state after step {step} hashed two ways")
                record["state_hash"], record["checkpoint_sha256"] = sh.hex(), fh.hex()
            elif "state_hash" not in record:  # (a state tree that opens the chunks is the state's hash already)
                # an online run hashes the ring's copy it just made, whose buffers it knows already
                kept = self.online.state_hash(done, self.digest) if self.online is not None and \
                    self.online.shard is None else None
                record["state_hash"] = (kept if kept is not None else
                                        self._timed(HASH, state_hash, state, self.digest)).hex()
        self._append_step(record)
        self.next_step = done

    def _timed(self, part: str, f: Callable[..., Any], *args: Any) -> Any:  # noqa: ANN401 - what ``f`` returns
        """``f(*args)``, its time added to the recorder's ``part``."""
        began = time.perf_counter()
        try:
            return f(*args)
        finally:
            self.part_seconds[part] += time.perf_counter() - began

    def _append_step(self, record: dict) -> None:
        """Append a step record (or, resuming, check it against the one signed before), then stream
        the head that its cadence or its checkpoint asks for."""
        step = record["step"]
        closes = "checkpoint_sha256" in record or (self.online is not None and (step + 1) % self.online.spec.every == 0)
        if closes and self._rounds:
            # the drand round of the window this record closes: bound by the root, so one per window
            if step < self._signed:  # as the record signed before the crash named it
                named = parse_canonical_json(self.log.lines[step + 1]).get("round")
                if named is not None:
                    record["round"] = named
            else:
                record["round"] = self.online.link.next_round()  # type: ignore[union-attr]
        if step < self._signed:
            if canonical_json(record) != self.log.lines[step + 1]:
                raise ValueError(f"resuming: step {step} does not come out as its signed record did (another "
                                 "machine, thread count or library?): the run cannot be continued here")
            old = self._old_heads.get(step + 2)
            if old is not None and self.online is not None:
                self.online.send(old)  # a head the beacon may not have stamped before the crash
            return
        self.writer.append_record(self.log.append(record))
        if closes:
            self._publish_head()

    def _hash_later(self, record: dict, state: dict, into: dict | None = None, n: int | None = None) -> None:
        """Hash ``state`` in the background; ``record`` is written with its hash by the next ``flush``.
        ``into``: host buffers to copy it into (the online ring's) instead of the snapshots' own; a
        chunked online run's chunk tree of the state after ``n`` updates is hashed from the same copy."""
        if self._snapshots is None:
            self._snapshots = StateSnapshots(self.optimizer, self.digest)
            # named as in the state: a distributed session's unwrapped module, not its DDP wrapper
            module = getattr(self.session, "module", self.model)
            self._early = frozenset(f"model.{n}" for n, _ in module.named_buffers())
        reduce = None
        online = self.online
        if online is not None and online.layout is not None and n is not None:
            def reduce(copies: dict) -> dict:
                fields = tree_fields(online.tree(n, into if into is not None else copies))  # type: ignore[arg-type]
                if "state_hash" not in fields:  # (one pass: the state tree is the state's hash already)
                    fields["state_hash"] = state_hash(copies, self.digest).hex()
                return fields
        self._deferred = (record, self._snapshots.submit(state, early=self._early, into=into, reduce=reduce))

    def flush(self) -> None:
        """Write the record still waiting for its state hash, if there is one (waits for the hash)."""
        if self._deferred is not None:
            record, pending = self._deferred
            self._deferred = None
            done = pending.result()
            if isinstance(done, dict):  # the state hash and what opens the parameters' chunks
                record |= done
            else:
                record["state_hash"] = done.hex()
            self._append_step(record)

    @contextlib.contextmanager
    def _unsigned_dropped_on_failure(self) -> Iterator[None]:
        """Where the self-check finds a step that does not replay, the bundle keeps what its heads
        signed and nothing after: the failed step's record, the records after it and their
        checkpoints go, so that ``--resume`` (which keeps an intact checkpoint's records) never
        continues, and signs, a run from a step that would not replay."""
        try:
            yield
        except SelfCheckFailed:
            signed = head_sizes(self.out / HEADS)
            keep = max(signed, default=1)
            truncate_lines(self.out / LOG, keep)
            for f in (self.out / CHECKPOINTS).iterdir():
                step = checkpoint_step(f"{CHECKPOINTS}/{f.name}")
                if step is not None and step > keep - 1:
                    f.unlink()
            raise

    def _publish_head(self, extensions: dict | None = None) -> SignedTreeHead:
        if self.self_check is not None:
            with self._unsigned_dropped_on_failure():
                self.self_check.settle()  # a sampled step being replayed: no head signs it before it passed
        head = self.log.sign_head(self.key, extensions=extensions)
        self.writer.append_head(head)
        if self.on_head is not None:
            self.on_head(head, self.log)
        if self.online is not None:
            self.online.send(head)
        return head
