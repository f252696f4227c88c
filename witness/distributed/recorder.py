"""The recorder under torchrun: every rank trains its micro-batch, rank 0 writes the one log.

Usage, inside a script started by ``torchrun`` after ``dist.init_process_group``::

    rec = DistRecorder(task, "run/", key, r=r, commit=Commitments(checkpoint_every=50), parallelism="fsdp")
    # (or rec = DistRecorder.resume("run/", key) after a kill; online with Online(beacon=...) or WITNESS_BEACON)
    for t in range(rec.start_step, task.config.steps):
        batch = rec.batch(t)                 # this rank's share of the committed global batch
        out = rec.train_step(t, batch)       # forward, backward (the wrapper averages), clip, step
        rec.log_step(t, out)                 # collectives, then rank 0 appends the record
    rec.finish()
    if rec.close():                          # the process group destroyed in order; threads left?
        exit_now()                           # then skip the interpreter's teardown
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..bundle.checkpoint import read_checkpoint
from ..bundle.layout import LOG, checkpoint_name, due, online_shard_name
from ..bundle.opened import ShardedState
from ..bundle.state import default_digest, parse_digest, root_from_shards, shard_digests
from ..bundle.writer import read_lines
from ..commit.hashing import parse_canonical_json
from ..data.order import derive_run_seed
from ..fingerprint.chunks import ChunkLayout
from ..record.options import Commitments, HeadCallback, Online, SelfChecking, Training, option
from ..record.overlap import StateSnapshots
from ..record.recorder import BEACON_ENV, Recorder
from ..record.records import tree_fields
from ..record.selfcheck import SelfCheck, check_steps
from ..record.start import reopen
from ..task.base import StepOutput, Task
from ..task.registry import build_task
from .online import Answers, Notes, ShardChunks, ShareRing, all_digests, exchange
from .session import DistSession


class DistRecorder:
    """Witnesses a DDP or FSDP2 run: the global batch is the ranks' micro-batches in rank order."""

    def __init__(self, task: Task, out: str | os.PathLike, key: Ed25519PrivateKey | None, *, r: bytes,
                 commit: Commitments | None = None, parallelism: str = "ddp", on_head: HeadCallback | None = None,
                 online: Online | None = None, self_check: SelfChecking | None = None):
        """``commit``: what the run commits and how often, as for ``Recorder.create`` (by default a
        state every step, a checkpoint every 50). Under DDP and FSDP2 every rank hashes its share of
        the rows (DDP's of its replica, FSDP2's the shards it holds) and sends rank 0 their digests
        (no gather); only a checkpoint gathers the whole state (DDP's rank 0 holds it already).
        ``on_head``: rank 0 calls it with every signed tree head (``Online.on_head``). ``online``: rank 0's online challenges (its beacon, spec
        and ring budget, as for ``Recorder.create``; the other ranks' is not read), by default from
        the beacon at ``WITNESS_BEACON``: every rank keeps its own share of each state in a ring of
        that budget and writes its share of each state a statement selects
        (``witness.distributed.online``). ``self_check``: under DDP, rank 0 replays step 0 and a
        later step as the verifier does (the ranks' micro-batches in rank order, in one process,
        from its own replica of the state), and samples later steps for its background checker
        (``witness.record.selfcheck``); under FSDP2 no rank holds the state a step starts from, so
        the run is not self-checked (the verifier's replay is the check)."""
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (torchrun) before the recorder")
        commit = option(commit, Commitments, "commit")
        dataset = task.dataset()
        world = dist.get_world_size()
        # over several ranks each hashes its own rows of the state (DDP's replica as FSDP2's shards);
        # every rank names the same digest: the same code and packages run on all of them
        own = getattr(self, "_own", None)  # a loop's own model and optimizer (witness.distributed.loop)
        self._setup(task, DistSession(task, derive_run_seed(dataset.root, r), len(dataset), parallelism, own),
                    commit.checkpoint_every, commit.state_every, default_digest(world))
        shards = parse_digest(self.digest)[1]
        check = option(self_check, SelfChecking, "self_check")
        started = self._on_rank0(lambda: self._create(task, out, key, r, commit, parallelism, shards, on_head, online,
                                                      check))
        if started["ring"] is not None and self.sharded:
            if started["chunks"]:  # each rank's rows of the parameters a subtree of the chunk tree
                layout = ChunkLayout.of_model(self.session.module, started["chunk_bytes"], shards)
                self._chunks = ShardChunks(layout, self.rank, shards, self.session.device, started["chunks"],
                                           self.digest if started["tree"] else None)
            if self.rank == 0:
                self._answers = Answers()
                self.inner.online.on_answer = self._answers.note  # type: ignore[union-attr]
                if self._chunks is not None:
                    self.inner.online.on_opening = self._chunks.opened_here  # type: ignore[union-attr]
            else:
                self._ring = ShareRing(out, self.rank, started["ring"], task.config.steps,
                                       self._chunks.mine if self._chunks is not None else None, bool(started["tree"]),
                                       started["hashed_by"])
            self._keep(0, *self.session.shard_pieces())  # the initial state: its share on every rank
        dist.barrier()

    @classmethod
    def resume(cls, out: str | os.PathLike, key: Ed25519PrivateKey | None, *, threads: int | None = None,
               self_check: SelfChecking | None = None) -> DistRecorder:
        """Continue a killed torchrun run on as many ranks as it started on (every rank calls this; rank
        0 with the key). Rank 0 reopens the bundle at an intact checkpoint, keeping every signed head
        valid (``witness.record.start.reopen``: records signed before the kill are trained again and
        must come out bit for bit the same); every rank then loads that checkpoint (DDP the whole
        replica, FSDP2 its rows). Train from ``rec.start_step``. The bundle must be on storage every
        rank reads."""
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (torchrun) before the recorder")
        out = Path(out)
        lines = read_lines(out / LOG)
        if not lines:
            raise ValueError(f"{out} holds no run to resume")
        m = parse_canonical_json(lines[0])  # every rank reads the recipe (the first line never changes)
        if m.get("world_size") != dist.get_world_size() or m.get("parallelism") not in ("ddp", "fsdp"):
            raise ValueError(f"the run in {out} trained on {m.get('world_size')} rank(s) with {m.get('parallelism')}: "
                             f"resume it so, not on {dist.get_world_size()}")
        task = build_task(m["task"], m["task_config"])
        if task.grad_accum > 1:
            raise ValueError(f"the run in {out} is a loop of its own (start_run under torchrun): resuming one is not "
                             "built (docs/distributed.md); start it again")
        self = cls.__new__(cls)
        self._setup(task, DistSession(task, bytes.fromhex(m["run_seed"]), m["dataset_size"], m["parallelism"]),
                    m["checkpoint_every"], m["state_every"], m["state_digest"])

        def reopened() -> dict:
            opened, _, heads = reopen(out, key, threads, None, session=self.session)
            self.inner = Recorder(key, opened)
            self.inner._old_heads = heads
            return {"at": opened.start_step}

        self.start_step = self._on_rank0(reopened)["at"]
        self.session.load_full_state(read_checkpoint(out / checkpoint_name(self.start_step)))
        # a resumed run is checked as a new one is: its first step here, and sampled later ones
        self._self_check(option(self_check, SelfChecking, "self_check"), [self.start_step])
        dist.barrier()
        return self

    def _setup(self, task: Task, session: DistSession, checkpoint_every: int, state_every: int, digest: str) -> None:
        """What a new and a resumed run share."""
        self.task, self.session, self.rank = task, session, session.rank
        self.checkpoint_every, self.state_every, self.digest = checkpoint_every, state_every, digest
        self.sharded = parse_digest(digest)[1] > 1  # (a DDP run recorded before issue 48: rank 0 hashed it whole)
        self.start_step = 0
        self.inner: Recorder | None = None
        self._answers: Answers | None = None  # rank 0's notes of answered statements (an online run)
        self._ring: ShareRing | None = None  # another rank's ring of its shares (an online run)
        self._asked: set[int] = set()  # rank 0: the states statements asked every rank for
        self._chunks: ShardChunks | None = None  # a chunked online run: the ranks' subtrees and openings
        # Off the training stream on a GPU (a side-stream copy, hashed in a background thread)
        self._overlap = self.session.device.type == "cuda"
        self._snapshots: StateSnapshots | None = None
        self._unsettled: tuple[Future, Future | None, dict | None] | None = None

    def _on_rank0(self, start: Callable[[], dict]) -> dict:
        """Collective: rank 0 starts (or reopens) the run; every rank gets what it says, or stops with
        its error (rather than wait at the next collective for a rank that is gone)."""
        said: dict = {}
        if self.rank == 0:
            try:
                said = start()
            except Exception as e:
                dist.broadcast_object_list([{"error": f"{type(e).__name__}: {e}"}], src=0)
                raise
        shared = [said]
        dist.broadcast_object_list(shared, src=0)
        if "error" in shared[0]:
            raise RuntimeError(f"rank 0 could not start the run: {shared[0]['error']}")
        return shared[0]

    def _create(self, task: Task, out: str | os.PathLike, key: Ed25519PrivateKey | None, r: bytes,
                commit: Commitments, parallelism: str, shards: int, on_head: HeadCallback | None,
                online: Online | None, check: SelfChecking) -> dict:
        """Rank 0's recorder, which signs the one log (and holds the beacon's link); says the ring's size."""
        if key is None:
            raise ValueError("rank 0 signs the log: it needs the key")
        online = option(online, Online, "online")
        if online.beacon is None and os.environ.get(BEACON_ENV):  # as start_run: a script goes online unchanged
            from ..beacon.client import BeaconClient

            online = dataclasses.replace(online, beacon=BeaconClient(os.environ[BEACON_ENV]))
        training = Training(session=self.session, init_state=self.session.init_state, parallelism=parallelism,
                            shards=shards)
        self.inner = Recorder.create(task, out, key, r=r, commit=commit, training=training,
                                     online=dataclasses.replace(online, on_head=on_head or online.on_head))
        self._self_check(check, check_steps(task.config.steps))
        spec = self.inner.online.spec if self.inner.online is not None else None
        return {"ring": spec.ring if spec is not None else None, "chunks": spec.chunks if spec is not None else 0,
                "chunk_bytes": spec.chunk_bytes if spec is not None else 0,
                "tree": spec.tree if spec is not None and spec.chunks else None,
                "hashed_by": spec.hashed_by if spec is not None else "host"}

    def _self_check(self, check: SelfChecking, steps: list[int]) -> None:
        """Rank 0 of a DDP run: replay ``steps`` and sampled later ones from its replica, as a verifier will."""
        if not check.enabled or self.session.parallelism != "ddp" or self.inner is None:
            return
        self.inner.self_check = SelfCheck(self.inner, steps, check.share)
        self.inner.self_check.prepare(self.inner.next_step)  # the committed state the first step starts from

    def _keep(self, n: int, pieces: dict[str, torch.Tensor], meta: dict) -> bytes | ShardedState | None:
        """Collective (an online run): this rank's share of the state after ``n`` updates into its ring.
        Rank 0 keeps its share first (waiting for the beacon where its ring is full), then tells the
        other ranks what the statements answered since asked for; they write and free, then keep. A
        chunked run then puts the windows' openings together, and rank 0 gets the state's ``param_root``
        (version 3), or its state tree, which is its hash (version 4: ``meta`` each tensor's dtype and
        whole shape)."""
        if self._answers is not None:
            tree = self.inner.online.keep(n, pieces)  # type: ignore[union-attr]
            notes, opened = self._notes()
        elif self._ring is not None:
            notes, opened = self._notes()
            tree = self._ring.keep(n, pieces)
        else:
            return None
        if self._chunks is None or tree is None:
            return None
        self._chunks.gather(notes, opened, self._write_openings)
        if self._chunks.digest:
            return self._chunks.state_tree(n, tree, meta)  # type: ignore[arg-type]
        return self._chunks.param_root(n, tree)  # type: ignore[arg-type]

    def _write_openings(self, size: int, first: int, chunks: list[int], pieces: list) -> None:
        """Rank 0: a window's openings, put together from every rank's part."""
        self.inner.online._write_openings(size, first, chunks, pieces)  # type: ignore[union-attr]

    @property
    def overlap(self) -> bool:
        """Whether committed states are hashed off the training stream (on by default on a GPU)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self._overlap = on
        if self.inner is not None:
            self.inner.overlap = on

    @property
    def model(self):
        """The wrapped model."""
        return self.session.model

    @property
    def optimizer(self):
        """Its optimizer."""
        return self.session.optimizer

    def batch(self, step: int) -> Any:
        """This rank's micro-batch of the committed global batch of ``step``, collated."""
        ds = self.task.dataset()
        idx = self.session.batch_indices(step)
        if self.inner is not None:
            self.inner.ready_for(step)  # the batch its record names, and the self-check's start of the step
        return self.task.collate([ds.sample_bytes(i) for i in self.session.my_share(idx)])

    def train_step(self, step: int, batch: Any) -> StepOutput:
        """The task's step on this rank's micro-batch, with this rank's dropout seed."""
        return self.session.local_step(step, batch)

    def log_step(self, step: int, out: StepOutput) -> None:
        """Collectives (loss, fingerprint, sketch, the state where it is committed), then rank 0 records."""
        self._settle()  # the previous state's root, before its record is written
        self.session.check_buffers()
        steps = self.task.config.steps
        committed = due(step, self.state_every, steps)
        total = self.session.global_output(out)
        fp = self.session.fingerprint()
        sketch = self.session.sketch()
        state = root = None
        pieces, meta = self.session.shard_pieces() if self.sharded and committed else (None, None)
        kept = tree = None
        if pieces is not None and (self._answers is not None or self._ring is not None):
            kept = self._keep(step + 1, pieces, meta)  # a host copy, before training changes it
        # (rank 0) the ranks' trees are the state's hash: not hashed again, and a checkpoint must hash to it
        one_pass = pieces is not None and self._chunks is not None and bool(self._chunks.digest)
        tree = tree_fields(kept) if kept is not None else None
        if committed and self.sharded and not due(step, self.checkpoint_every, steps):
            root = kept.root if isinstance(kept, ShardedState) else None if one_pass else self._hash_shards()
        elif committed:
            state = self.session.full_state()  # a checkpoint's state is written whole: gathered
        if self.inner is not None:
            self.inner.log_step(step, total, fingerprint=fp, sketch=sketch, state=state,
                                live=self.session.holds_whole_state(), state_root=root, tree=tree)

    def _hash_shards(self) -> bytes | Future | None:
        """Every rank hashes the rows it holds; rank 0 gets the root (or a future of it, when the
        hashing runs off the training stream: settled at the next record)."""
        pieces, layout = self.session.shard_pieces()
        if self.rank != 0:
            layout = None  # only rank 0 composes the root
        if not self.overlap:
            return self._exchange(shard_digests(pieces, self.digest), layout)
        if self._snapshots is None:
            self._snapshots = StateSnapshots(self.session.optimizer, self.digest)
        local = self._snapshots.submit(pieces, reduce=lambda copies: shard_digests(copies, self.digest))
        root: Future | None = Future() if self.rank == 0 else None
        self._unsettled = (local, root, layout)
        return root

    def _settle(self) -> None:
        """Collective: finish the state root that is still being hashed, if there is one."""
        if self._unsettled is None:
            return
        local, root, layout = self._unsettled
        self._unsettled = None
        value = self._exchange(local.result(), layout)
        if root is not None:
            root.set_result(value)

    def _exchange(self, digests: dict[str, str], layout: dict | None) -> bytes | None:
        """Collective: every rank's digests to every rank (fixed-size rows); rank 0 composes the root."""
        ranks = all_digests(digests, self.session.device, self.session.world_size, self.rank)
        if layout is None or ranks is None:
            return None
        return root_from_shards(layout, ranks, self.digest)

    def finish(self) -> None:
        """Rank 0 signs the end (an online run: once every statement is answered, and every rank has
        written its shares of the states they ask for); everyone waits for it."""
        self._settle()
        if self._snapshots is not None:
            self._snapshots.close()
        if self.inner is not None:
            self.inner.finish()
        if self._answers is not None or self._ring is not None:
            notes, opened = self._notes()  # the last statements' notes
            if self._chunks is not None:
                self._chunks.gather(notes, opened, self._write_openings)
        if self._ring is not None:
            self._ring.finish()
        dist.barrier()
        if self._answers is not None:  # every rank's share where rank 0 reads the bundle (storage they all write)
            world = self.session.world_size
            lost = [(n, r) for n in sorted(self._asked) for r in range(world)
                    if not (self.inner.out / online_shard_name(n, r)).exists()]  # type: ignore[union-attr]
            if lost:
                raise RuntimeError(f"rank {lost[0][1]}'s share of the state after {lost[0][0]} update(s) is not in "
                                   f"{self.inner.out} ({len(lost)} share(s) missing): the ranks must write the bundle "  # type: ignore[union-attr]
                                   "to storage they share (one host, or a shared file system)")

    def _notes(self) -> tuple[Notes, dict]:
        """Collective (an online run): rank 0's notes of the statements answered since the last call go to
        every rank (rank 0 remembers the states they asked for); another rank writes its shares of those
        and frees the rest, and returns its part of the windows' openings (rank 0's it keeps itself)."""
        if self._answers is not None:
            notes = self._answers.take()
            for _, needed, _ in notes:
                self._asked.update(needed)
            exchange(notes, self.session.device)
            return notes, {}
        notes = exchange(None, self.session.device)
        return notes, self._ring.answer(notes)  # type: ignore[union-attr]

    def report(self) -> dict | None:
        """What keeping and writing this rank's shares cost (an online run; rank 0's is its link's too)."""
        if self.inner is not None and self.inner.online is not None:
            return self.inner.online.report()
        return self._ring.report() if self._ring is not None else None

    def close(self) -> list[str]:
        """After ``finish``: tear the run down in order, and say which backend threads outlive it.

        ``destroy_process_group`` alone leaves the group alive while anything still holds it (the
        DDP wrapper's reducer does), so its C++ threads would be joined, and the last collectives'
        tensors released, only while the interpreter shuts down. A C++ thread that then needs the
        GIL is ended by CPython mid-call, which aborts the process ("terminate called without an
        active exception"). So: drop the wrapped model and optimizer, collect them, then destroy
        the group, whose threads are then joined here. Returns the names of the backend threads
        still running (Linux; under FSDP2, DTensor's caches keep its device mesh, and with it the
        group, alive): where there are any, end the process with ``exit_now``.
        """
        self._snapshots = self._unsettled = self.inner = None
        self.session = None  # type: ignore[assignment]
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        return backend_threads()


# thread names of the collective backends' own C++ threads (gloo's and nccl's)
BACKEND_THREADS = ("gloo", "pt_gloo", "pt_nccl", "nccl")


def backend_threads() -> list[str]:
    """Names of this process's collective-backend threads still running (Linux; else none known)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm", encoding="ascii", errors="replace") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(BACKEND_THREADS):
            names.append(name)
    return sorted(names)


def exit_now(code: int = 0) -> None:
    """End the process at once, after flushing the standard streams: what a torchrun script does
    after ``DistRecorder.close`` reports backend threads still running (the bundle is already
    durable: ``finish`` fsyncs every signed head), so that the interpreter's teardown, during which
    such a thread could abort the process, never runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
