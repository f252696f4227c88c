"""The recorder: wraps the trainer's own loop and writes a signed witness bundle.

Usage, in the trainer's loop::

    rec = Recorder.create(task, "run/", key, r=os.urandom(32), commit=Commitments(checkpoint_every=50))
    for t in range(rec.start_step, task.config.steps):
        batch = rec.batch(t)
        out = task.train_step(rec.step_model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        rec.log_step(t, out)
    rec.finish()

(``rec.step_model`` is ``rec.model``, or its ``torch.compile`` wrapper where the recipe compiles.)
The options (``Commitments``, ``Training``, ``Online``, ``SelfChecking``) are in
``witness.record.options``; how a run starts or resumes is ``witness.record.start``, and how its
records and heads are written ``witness.record.records``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..bundle.checkpoint import read_checkpoint
from ..bundle.layout import checkpoint_name
from ..bundle.state import model_hash
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.signing import SignedTreeHead
from ..data.usage import used_roots
from ..task.base import Task, micro_seed, model_device, scaler_of, step_randomness, to_device
from .loop import Batches, Hooked
from .options import Commitments, HeadCallback, Online, SelfChecking, Training, option
from .records import HASH, PROBES, Records
from .selfcheck import SelfCheck, check_steps
from .start import begin, challenges, reopen

__all__ = ["HeadCallback", "Recorder", "start_run"]

HINT_OVER = 0.05  # the recorder's fixed cost, as a share of a step, above which it suggests --state-every
BEACON_ENV = "WITNESS_BEACON"  # start_run's beacon where the script names none


class Recorder(Records):
    """Writes the manifest before step 0, then one record per step, around the trainer's loop
    (how a record and its head are written: ``Records``)."""

    _hooked: Hooked | None = None  # the hooks that record a loop's own steps (rec.batches)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, task: Task, out: str | os.PathLike, key: Ed25519PrivateKey, *, r: bytes,
               commit: Commitments | None = None, training: Training | None = None, online: Online | None = None,
               self_check: SelfChecking | None = None) -> Recorder:
        """Start a new run: derive the seed, build the initial state, sign the manifest.

        ``commit``: what the manifest commits the run to (how often a state is committed and
        written whole, the dataset's leaves in the bundle, who chose ``r``). ``training``: the
        loop's own model and optimizer (adopted: the model takes the initial state a verifier
        rebuilds, and ``rec.batches(get_batch)`` then records each step when ``optimizer.step()``
        returns, ``witness.record.loop``), the device, the thread count; a torchrun run's session
        (``witness.distributed`` fills it in). ``online``: each signed head to ``on_head`` (a
        leaderboard's streamer), and with a ``beacon`` online challenges, the states its statements
        select kept (``spec``: by default ``OnlineSpec.for_steps``). ``self_check``: step 0 and one
        random later step replayed as a verifier will, right after they are recorded, and later
        steps sampled and replayed in the background for at most ``share`` of the loop's step time
        (a mismatch stops the run before its next tree head is signed). Each left out is at its
        defaults (``witness.record.options``).
        """
        commit, training = option(commit, Commitments, "commit"), option(training, Training, "training")
        online, self_check = option(online, Online, "online"), option(self_check, SelfChecking, "self_check")
        opened, init_state, spec = begin(task, out, key, r, commit, training, online)
        ring = None
        if online.beacon is not None:
            ring = challenges(opened.out, opened.session, opened.manifest, spec, online.beacon, key, opened.log)
            if training.shards > 1:
                ring.shard = 0  # rank 0's share of each state; the other ranks keep theirs (witness.distributed)
        rec = cls(key, opened, online.on_head, ring)
        if self_check.enabled and opened.session.world_size == 1 and training.parallelism == "none":
            rec.self_check = SelfCheck(rec, check_steps(task.config.steps), self_check.share)
        if ring is not None and training.shards == 1:  # over several ranks, each keeps its share of it
            ring.keep(0, init_state)
        rec._publish_head()  # the manifest is signed before step 0
        if rec.self_check is not None:
            rec.self_check.prepare(0)  # the initial state, as committed: what step 0 is replayed from
        return rec

    @classmethod
    def resume(cls, out: str | os.PathLike, key: Ed25519PrivateKey, *, threads: int | None = None,
               online: Online | None = None, self_check: SelfChecking | None = None) -> Recorder:
        """Continue a killed run from an intact checkpoint, keeping every signed head valid
        (``witness.record.start.reopen``), at the run's own thread count unless ``threads`` is
        given. An online run resumes with its beacon (``Online(beacon=...)``; its settings are the
        manifest's); a resumed run is self-checked as a new one is."""
        online, self_check = option(online, Online, "online"), option(self_check, SelfChecking, "self_check")
        if online.spec is not None:
            raise ValueError("a resumed run takes online challenges with the settings its manifest names: give "
                             "Online(beacon=...) without a spec")
        opened, ring, heads = reopen(out, key, threads, online.beacon)
        rec = cls(key, opened, online.on_head, ring)
        rec._old_heads = heads
        manifest = opened.manifest
        if self_check.enabled and manifest.get("world_size", 1) == 1 and manifest.get("parallelism", "none") == "none":
            # a resumed run is checked as a new one is: its first step here, sampled later ones, every rate
            rec.self_check = SelfCheck(rec, [opened.start_step], self_check.share)
            rec.self_check.prepare(opened.start_step)
        return rec

    # --- what the trainer's loop calls --------------------------------------------------
    @property
    def scaler(self) -> Any:  # noqa: ANN401 - a torch.amp.GradScaler, or None
        """An fp16 run's ``GradScaler`` (None otherwise): scale, unscale and step with it, as
        ``task.train_step`` does; its scale is committed with the optimizer's state."""
        return scaler_of(self.optimizer)

    @property
    def step_model(self) -> torch.nn.Module:
        """What a loop runs the step with: the model, or its ``torch.compile`` wrapper (the same
        parameters) where the recipe compiles (``compile=True``), exactly what replay runs."""
        return self.session.step_model

    def lr(self, step: int) -> float:
        """The committed schedule's learning rate."""
        return self.session.lr(step)

    def step_seed(self, step: int) -> int:
        """The committed seed of the randomness inside ``step``."""
        return self.session.step_seed(step)

    def batch_indices(self, step: int) -> list[int]:
        """Dataset indices of the committed batch of ``step``."""
        return self.session.batch_indices(step)

    def batch(self, step: int) -> Any:
        """The committed batch of ``step``, collated into tensors."""
        self.ready_for(step)
        return self.committed_batch(step)

    def committed_batch(self, step: int) -> Any:
        """The committed batch of ``step`` (nothing else is noted: a loop may fetch it ahead)."""
        return self.task.collate(self.session.batch_samples(step))

    def ready_for(self, step: int) -> None:
        """Before the loop trains ``step``: note its committed batch (what ``log_step`` records) and
        the state it starts from (the self-check's)."""
        if self.self_check is not None and self.self_check.failed is not None:
            raise self.self_check.failed  # a run stopped by its self-check takes no step after
        self._within_recipe(step)
        ds = self.task.dataset()
        idx = self.batch_indices(step)
        self.expect(step, idx, ds.batch_root(idx))
        if self.self_check is not None:
            began = time.perf_counter()
            with self._unsigned_dropped_on_failure():
                self.self_check.start(step)  # the state this step starts from (and any sampled step's answer)
            self._aside += time.perf_counter() - began  # the recorder's work, not the loop's step

    def batches(self, source: Callable[..., Any] | Any = None) -> Batches:  # noqa: ANN401 - a loop's own
        """The committed batches, for a loop that uses its own model and optimizer
        (``Training(model=...)`` at create): ``get_batch = rec.batches(get_batch)`` or ``for x, y
        in rec.batches(loader)``. Each call (or item) is the next committed micro-batch; an
        evaluation's call goes to ``source``. From then on every ``optimizer.step()`` records its
        step (``witness.record.loop``)."""
        if self._hooked is None:
            self._hooked = Hooked(self, self.model, self.optimizer)
        return Batches(self._hooked, source)

    def micro_batches(self, step: int) -> Iterator[Any]:
        """The committed batch of ``step`` as the recipe's ``grad_accum`` micro-batches, in order, on
        the model's device; while the loop works on each (its forward and backward), the global
        generators (torch's, Python's, NumPy's) are seeded from that micro-batch's seed, as replay
        seeds them, and given back their state after. A loop written as ``for x, y in
        rec.micro_batches(t): loss = model(x, y) / G; loss.backward()`` then draws the dropout
        masks replay draws, whoever wrote the model."""
        batch = self.batch(step)
        parts = self.task.split_batch(batch, self.task.grad_accum) if self.task.grad_accum > 1 else [batch]
        seed = self.step_seed(step)
        device = model_device(self.model)
        for k, part in enumerate(parts):
            with step_randomness(seed if len(parts) == 1 else micro_seed(seed, k), device):
                yield to_device(part, device)

    def finish(self) -> SignedTreeHead:
        """Append the end record and sign the final tree head."""
        if self._hooked is not None:
            self._hooked.close()
        self.flush()
        if self._snapshots is not None:
            self._snapshots.close()
        if self.next_step != self.task.config.steps:
            raise ValueError(f"the recipe has {self.task.config.steps} steps; {self.next_step} were logged")
        # a resumed online run whose end record was signed before the crash (its last windows were
        # still waiting for their rounds): the end record must come out as signed, and its head goes again
        ended = len(self.log) == self.next_step + 2
        records = [parse_canonical_json(line) for line in self.log.lines[1:self.next_step + 1]]
        usage = used_roots(self.task.dataset().leaves, (r["batch"] for r in records))
        final_state = read_checkpoint(self.out / checkpoint_name(self.next_step))
        final = {"final_state_hash": records[-1]["state_hash"],
                 "final_model_hash": model_hash(final_state, self.digest).hex()}
        ext = usage | final | {"task": self.task.name}  # the head names its task: whose rule decides documents
        end = {"type": "end", "steps": self.next_step} | ext
        if ended:
            named = parse_canonical_json(self.log.lines[-1]).get("round")
            if named is not None:
                end["round"] = named
            old = self._old_heads.get(len(self.log))
            if canonical_json(end) != self.log.lines[-1] or old is None:
                raise ValueError("resuming: the end record does not come out as its signed one did: the run cannot "
                                 "be finished here")
            head = old
            if self.online is not None:
                self.online.send(head)  # its window, if the crash lost it
        else:
            if self._rounds:
                end["round"] = self.online.link.next_round()  # type: ignore[union-attr]
            self.writer.append_record(self.log.append(end))
            head = self._publish_head(extensions=ext)
        if self.online is not None:
            self.online.finish()  # every statement received, every selected state written
        self.writer.close()
        print(self.closing_line(), file=sys.stderr)  # in your own loop too: what witnessing cost, and where
        if self.self_check is not None:
            self.self_check.close()
            if self.self_check.checked:  # in your own loop too: it ran, at this cost (its line stays the last)
                print(self.self_check.summary(), file=sys.stderr)
        return head

    def train(self, progress: bool = True) -> SignedTreeHead:
        """The honest loop, for runs that need nothing custom."""
        from tqdm import tqdm

        bar = tqdm(range(self.start_step, self.task.config.steps), desc=f"training {self.task.name}",
                   unit="step", disable=not progress, initial=self.start_step, total=self.task.config.steps)
        with self.stopped_on_failure():
            for t in bar:
                out = self.task.train_step(self.step_model, self.optimizer, self.batch(t), self.lr(t),
                                           self.step_seed(t))
                self.log_step(t, out)
                bar.set_postfix(loss=f"{out.loss:.3f}")
            return self.finish()

    @contextlib.contextmanager
    def stopped_on_failure(self) -> Iterator[None]:
        """Around a training loop: where it fails (a beacon that refused a head, Ctrl-C), the
        recorder's background work stops with it, its queued heads no longer sent (the bundle keeps
        what was written, a prefix that verifies and resumes)."""
        try:
            yield
        except BaseException:
            if self._hooked is not None:
                self._hooked.close()
            if self.self_check is not None:
                self.self_check.close(now=True)
            if self.online is not None:
                self.online.close()
            if self._snapshots is not None:
                self._snapshots.close()
            raise

    def cost(self) -> dict:
        """The recorder's cost against the loop's own step time (its self-check apart), and where it
        is over 5 % of a step with the state committed at every step, a ``--state-every K`` that
        brings it near 5 % and what that costs the audit."""
        checked = self.self_check.local_seconds() if self.self_check is not None else 0.0
        record = max(self.record_seconds - checked, 0.0)
        total = self.step_seconds + record
        share = record / total if total > 0 else 0.0
        per_step = record / self.step_seconds if self.step_seconds > 0 else 0.0
        parts = dict(self.part_seconds)
        largest = max(parts, key=parts.__getitem__) if any(parts.values()) else None
        hint, k = None, None
        if per_step > HINT_OVER:
            hint = (f"the recorder's fixed cost is {100 * per_step:.0f}% of a training step ({record:.2f} s against "
                    f"{self.step_seconds:.2f} s of steps)")
            if largest is not None:  # measured, never assumed (the probes' forward can outweigh the hash)
                hint += f", most of it {largest} ({100 * parts[largest] / max(record, parts[largest]):.0f}%)"
            if largest == HASH and self.state_every == 1 and self.task.config.steps > 1:
                # every K steps the hash is paid 1/K as often
                k = min(max(2, math.ceil(per_step / HINT_OVER)), self.task.config.steps)
                hint += (f": --state-every {k} (Commitments(state_every={k})) commits it every {k} steps instead; the "
                         f"cheap audit then replays up to {k} steps a challenge (about {(k + 1) / 2:g} on average, "
                         f"{(k + 1) / 2:g}x its cost now for the same confidence)")
            elif largest == PROBES:
                hint += (": a recipe with fewer or shorter probes makes each record cheaper (the fingerprint then "
                         "looks at less of the model's behaviour)")
        return {"step_seconds": self.step_seconds, "record_seconds": record, "share": share, "per_step": per_step,
                "parts": parts, "largest": largest, "state_every_hint": k, "hint": hint}

    def closing_line(self) -> str:
        """What witnessing this loop cost, and its largest part (every witnessed loop ends with it)."""
        c = self.cost()
        largest = f"; its largest part: {c['largest']}" if c["largest"] else ""
        return (f"witnessing cost {100 * c['share']:.1f}% of the run's time ({c['record_seconds']:.2f} s recording "
                f"against {c['step_seconds']:.2f} s of training steps){largest}")


def start_run(task: str, settings: dict, out: str, *, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer | None = None, key: str = "witness-key.pem",
              beacon: str | None = None, **kwargs: Any) -> Recorder:  # noqa: ANN401
    """Witness a loop in one line: the task ``task`` (an installed plugin's) with the recipe its
    ``recipe_from`` reads off the loop's ``settings`` and ``model``, the loop's own model and
    optimizer adopted, a key at ``key`` (created there if missing), a fresh random ``r``, and online
    challenges from the beacon at ``beacon`` if one is named (by default the ``WITNESS_BEACON``
    environment variable's URL where it is None or empty, so that any witnessed script goes online without a change).
    ``kwargs`` go to ``Recorder.create`` (``commit=``, ``self_check=``; a ``training=`` or
    ``online=`` given there takes the model, optimizer and beacon named here)."""
    from ..commit.signing import load_or_create_key
    from ..task.registry import build_task, task_class

    built = build_task(task, task_class(task).recipe_from(settings, model))
    training = dataclasses.replace(option(kwargs.pop("training", None), Training, "training"), model=model,
                                   optimizer=optimizer)
    online = option(kwargs.pop("online", None), Online, "online")
    if online.beacon is None:
        beacon = beacon or os.environ.get(BEACON_ENV)  # an empty setting (nanoGPT's default) is none given
    elif beacon:
        raise ValueError("start_run takes one beacon: beacon=URL, or online=Online(beacon=...)")
    if beacon:
        from ..beacon.client import BeaconClient

        online = dataclasses.replace(online, beacon=BeaconClient(beacon))
    return Recorder.create(built, out, load_or_create_key(Path(key)), r=os.urandom(32), training=training,
                           online=online, **kwargs)
