"""The recorder: wraps the trainer's own loop and writes a signed witness bundle.

Usage, in the trainer's loop::

    rec = Recorder.create(task, "run/", key, r=os.urandom(32), checkpoint_every=50)
    for t in range(rec.start_step, task.config.steps):
        batch = rec.batch(t)
        out = task.train_step(rec.step_model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        rec.log_step(t, out)
    rec.finish()

(``rec.step_model`` is ``rec.model``, or its ``torch.compile`` wrapper where the recipe compiles.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .. import __version__, replays
from ..bundle.checkpoint import file_sha256, read_checkpoint, save_checkpoint
from ..bundle.layout import (
    CHECKPOINTS,
    COSIGNED,
    HEADS,
    LEAVES,
    LOG,
    ONLINE,
    PROBES,
    checkpoint_name,
    checkpoint_step,
    due,
    partial_write,
)
from ..bundle.schema import CHUNKED_MANIFEST_VERSION, MANIFEST_VERSION, Manifest
from ..bundle.state import default_digest, load_state, model_hash, state_hash, state_tensors
from ..bundle.writer import BundleWriter, head_sizes, read_lines, truncate_lines
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead, public_hex
from ..data.dataset import DATA_COMMITMENT
from ..data.locate import asked, is_absolute, side_files
from ..data.order import derive_run_seed
from ..data.usage import used_roots
from ..fingerprint.chunks import ChunkLayout
from ..fingerprint.moves import move_rules, one_rate
from ..session import (
    TrainingSession,
    bounded_threads,
    describe_device,
    deterministic_device,
    device_info,
    same_hardware,
    torch_version,
    warn_mkl,
)
from ..task.base import (
    StepOutput,
    Task,
    micro_seed,
    model_device,
    scaler_of,
    step_randomness,
    to_device,
)
from ..task.registry import build_task, check_task_source, task_class, task_source
from .background import DEFAULT_SHARE
from .loop import Batches, Hooked, adopt, off_by_one_hint
from .online import BeaconLink, OnlineChallenges, OnlineSpec
from .selfcheck import SelfCheck, SelfCheckFailed, check_steps

HeadCallback = Callable[[SignedTreeHead, RunLog], None]


def check_no_paths(recipe: Any, where: str = "recipe") -> None:
    """Refuse a recipe that names an absolute path: a verifier's data lies elsewhere, so a recipe
    names its data relative to a data folder (``witness.data.locate.data_file``)."""
    if isinstance(recipe, dict):
        for k, v in recipe.items():
            check_no_paths(v, f"{where}.{k}")
    elif isinstance(recipe, list):
        for i, v in enumerate(recipe):
            check_no_paths(v, f"{where}[{i}]")
    elif isinstance(recipe, str) and is_absolute(recipe):
        raise ValueError(f"{where} is the absolute path {recipe!r}: a verifier's copy of the data lies elsewhere. "
                         "Name the file relative to a data folder, read it with witness.data.locate.data_file(name), "
                         "and pass the folder with --data DIR (or WITNESS_DATA)")


HINT_OVER = 0.05  # the recorder's fixed cost, as a share of a step, above which it suggests --state-every


class Recorder:
    """Writes the manifest before step 0, then one record per step.

    A record commits the hash of the whole training state after its step every ``state_every``
    steps (default: every step), and a checkpoint file every ``checkpoint_every`` steps.
    """

    def __init__(self, task: Task, out: Path, key: Ed25519PrivateKey, session: TrainingSession,
                 writer: BundleWriter, log: RunLog, manifest: dict, start_step: int,
                 on_head: HeadCallback | None, online: OnlineChallenges | None = None):
        self.task, self.out, self.key = task, Path(out), key
        self.session, self.writer, self.log, self.manifest = session, writer, log, manifest
        self.start_step = self.next_step = start_step
        self.checkpoint_every = manifest["checkpoint_every"]
        self.state_every = manifest["state_every"]
        self.digest = manifest["state_digest"]
        self.on_head = on_head
        self._pending: tuple[int, list[int], bytes] | None = None
        # Off the training stream by default on a GPU, where the host is otherwise idle while the
        # device computes; on the CPU the hash thread would only compete with training's threads.
        self.overlap = session.device.type == "cuda"
        self._snapshots = None
        self._early: frozenset[str] = frozenset()  # buffers a forward changes: copied ahead of it
        self._deferred: tuple[dict, Any] | None = None  # a record waiting for its state hash
        self.online = online  # the beacon's statements and the ring of states they may select
        # a resumed run passes its signed records again from a checkpoint: each must come out the same
        self._signed = len(log) - 1
        self._old_heads: dict[int, SignedTreeHead] = {}
        self.self_check: SelfCheck | None = None  # replays a few steps as they are recorded (create's)
        # where the time goes: the loop's steps, and the recorder's work on their records
        self.step_seconds = self.record_seconds = 0.0
        self._left: float | None = None
        self._aside = 0.0  # the recorder's own work between two records (the self-check's copy)
        self._hooked: Hooked | None = None  # the hooks that record a loop's own steps (rec.batches)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, task: Task, out: str | os.PathLike, key: Ed25519PrivateKey, *, r: bytes,
               r_source: str = "trainer", checkpoint_every: int = 50, state_every: int = 1,
               threads: int | None = None, on_head: HeadCallback | None = None,
               session: TrainingSession | None = None, init_state: dict | None = None,
               parallelism: str = "none", device: str | torch.device = "cpu", shards: int = 1,
               leaves: bool = True, beacon: BeaconLink | None = None, online: OnlineSpec | None = None,
               self_check: bool = True, self_check_share: float = DEFAULT_SHARE,
               model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> Recorder:
        """Start a new run: derive the seed, build the initial state, sign the manifest.

        ``model`` (and ``optimizer``) are the loop's own: the model is given, in place, the initial
        state the task builds from the run seed (what a verifier rebuilds), and the optimizer is
        checked against the recipe's (by default the recipe's is built on the loop's model). Then
        ``rec.batches(get_batch)`` hands the loop its committed batches and each step is recorded
        when ``optimizer.step()`` returns (``witness.record.loop``).

        ``leaves`` writes the dataset's per-sample commitments into the bundle (``dataset.leaves``,
        64 bytes a sample): without them a verifier needs the file from elsewhere (``--leaves``),
        which suits a large corpus whose leaves are published once for all its runs.

        A distributed run passes its own ``session`` (wrapped model) and the ``init_state`` taken
        before wrapping, and an FSDP2 run over several ranks the number of row ``shards`` its state
        digest splits tensors into (one per rank); everything else is the same.

        ``beacon`` turns on online challenges: a head goes to it every ``online.every`` steps
        (default settings: ``OnlineSpec.for_steps``), and the states its statements select are kept.

        ``self_check`` replays step 0 and one random later step as a verifier will, right after
        they are recorded, and stops with what differs if the bits are not the same (a
        single-process run; it costs two steps and, while one is checked, a second model). Later
        steps are sampled and replayed in the background by a checker process, for at most
        ``self_check_share`` of the loop's step time (1 % by default); a mismatch stops the run
        before its next tree head is signed.
        """
        if len(r) != 32:
            raise ValueError("r must be 32 bytes")
        if not 0 <= self_check_share <= 1:
            raise ValueError(f"the self-check's share of training is a fraction in [0, 1], not {self_check_share!r}")
        if online is not None and beacon is None:
            raise ValueError("online challenges need a beacon")
        if beacon is not None:
            chain = getattr(getattr(beacon, "chain", None), "hash", None)  # a witnessed link's drand chain
            online = online or OnlineSpec.for_steps(task.config.steps, drand=chain.hex() if chain else None)
            if chain and online.drand is None:
                online = dataclasses.replace(online, drand=chain.hex())
            if state_every != 1 or shards != 1:
                raise ValueError("online challenges need the whole state committed at every step (state_every 1, "
                                 "one state digest shard)")
        if state_every < 1 or checkpoint_every < 1 or checkpoint_every % state_every:
            raise ValueError("checkpoint_every must be a multiple of state_every (every checkpoint is a committed state)")
        if threads:
            torch.set_num_threads(bounded_threads(threads))
        warn_mkl()
        # Only a task a verifier can build is worth recording: built in, or from an installed
        # plugin (whose code the manifest pins); an unregistered class would be unverifiable.
        if task_class(task.name) is not type(task):
            raise ValueError(f"the task {task.name!r} being recorded is not the registered class of that name")
        source = task_source(task.name)
        check_no_paths(task.config_json())
        with asked() as read:  # the data files the task reads: the small ones are pinned by content
            dataset = task.dataset()
            task.probe_bytes()
        # a task built before in this process (build_task's cache) read its files then: it noted them
        read += [n for n in getattr(task, "data_names", list)() if n not in read]
        if dataset.DOCUMENT_RULE != task.document_rule:
            raise ValueError(f"the task {task.name!r} decides document rule {task.document_rule!r}, but its "
                             f"dataset gives documents under {dataset.DOCUMENT_RULE!r}: a verifier would reject "
                             "every data claim of the run")
        # the commitment this release writes (a test may ask for an older release's, to check that
        # runs recorded by it still verify)
        version = DATA_COMMITMENT
        data_root = dataset.commitment_root(version)
        run_seed = derive_run_seed(data_root, r)
        multi = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        if model is not None and (session is not None or parallelism != "none" or multi):
            raise ValueError("the loop's own model is adopted in a single-process run; a torchrun run is recorded "
                             "with witness.distributed (docs/distributed.md)")
        if optimizer is not None and model is None:
            raise ValueError("the loop's own optimizer comes with the model it steps (model=...)")
        if model is not None and str(device) == "cpu":
            device = model_device(model)  # where the loop put its model
        if session is None:
            with asked() as built:
                session = TrainingSession(task, run_seed, len(dataset), device=device)
            read += [n for n in built if n not in read]
        elif session.run_seed != run_seed:
            raise ValueError("the session was built from another run seed")
        if model is not None:
            adopt(session, model, optimizer)
        if online is not None and online.chunks:
            rules = move_rules(getattr(session, "module", session.model), session.optimizer)
            if isinstance(rules, str):  # no bound to check a step's move against: the chunks would prove nothing
                print(f"witness: the bounded-move check is off for this run: {rules}", file=sys.stderr)
                online = dataclasses.replace(online, chunks=0)
        writer = BundleWriter(Path(out), create=True)
        if leaves and version >= 2:  # the per-sample commitments, which the cheap audit checks every step against
            dataset.leaves.write(Path(out) / LEAVES, data_root)
        # the probes travel with the bundle (their hash is the manifest's probe_hash): a verifier
        # without the training data still has them, and checks them against the committed leaves
        (Path(out) / PROBES).write_bytes(canonical_json([p.hex() for p in task.probe_bytes()]))
        if init_state is None:
            init_state = state_tensors(session.model, session.optimizer)
        digest = default_digest(shards)
        init_hash, init_file = save_checkpoint(Path(out) / checkpoint_name(0), init_state, 0, digest)
        manifest = {
            "type": "manifest",
            "format_version": CHUNKED_MANIFEST_VERSION if online is not None and online.chunks else MANIFEST_VERSION,
            "task": task.name,
            "task_config": task.config_json(),
            "code_version": __version__,
            "r": r.hex(),
            "r_source": r_source,
            "run_seed": run_seed.hex(),
            "data_root": data_root.hex(),
            "dataset_size": len(dataset),
            "probe_hash": task.probe_hash().hex(),
            "fingerprint_spec": task.fingerprint_spec(),
            "checkpoint_every": checkpoint_every,
            "state_every": state_every,
            "state_digest": digest,
            "steps_planned": task.config.steps,
            "world_size": session.world_size,
            "parallelism": parallelism,
            "threads": torch.get_num_threads(),
            "versions": {"torch": torch_version(), "device": device_info(session.device, task.compiles)},
            "public_key": public_hex(key.public_key()),
            "init_state_hash": init_hash.hex(),
            "init_checkpoint_sha256": init_file.hex(),
        }
        if version >= 2:
            manifest["data_commitment"] = version
        if source is not None:  # a plugin task: pin the exact installed code a verifier must have
            manifest["task_source"] = source.to_json()
        if online is not None:
            manifest["online"] = online.to_json()
        pins = side_files(read)
        if pins:  # so that a verifier finds each wherever it lies, by its content
            manifest["data_files"] = pins
        log = RunLog()
        writer.append_record(log.append(manifest))
        rec = cls(task, Path(out), key, session, writer, log, manifest, 0, on_head)
        if self_check and session.world_size == 1 and parallelism == "none":
            rec.self_check = SelfCheck(rec, check_steps(task.config.steps), self_check_share)
        if beacon is not None:
            rec.online = rec._online(online, beacon)  # type: ignore[arg-type]
            rec.online.keep(0, init_state)
        rec._publish_head()  # the manifest is signed before step 0
        if rec.self_check is not None:
            rec.self_check.prepare(0)  # the initial state, as committed: what step 0 is replayed from
        return rec

    @classmethod
    def resume(cls, out: str | os.PathLike, key: Ed25519PrivateKey, *, threads: int | None = None,
               on_head: HeadCallback | None = None, beacon: BeaconLink | None = None, self_check: bool = True,
               self_check_share: float = DEFAULT_SHARE) -> Recorder:
        """Continue a killed run from an intact checkpoint, keeping every signed head valid.

        Records that a head signed already are trained again from the checkpoint before them and
        must come out bit for bit the same. An online run resumes from the checkpoint before the
        first state it may still be asked for (a selected state the crash lost, or the first step no
        statement covers), with every statement the beacon gave kept or fetched again.
        """
        out = Path(out)
        lines = read_lines(out / LOG)
        if not lines:
            raise ValueError(f"{out} holds no run to resume")
        manifest = parse_canonical_json(lines[0])
        if manifest["public_key"] != public_hex(key.public_key()):
            raise ValueError("the run was signed with another key")
        if manifest["world_size"] != 1:
            raise ValueError("resuming a distributed run is not supported yet")
        started = Manifest.parse(manifest)
        # the rest of the run must be trained by the same code as its start (a plugin may have changed)
        if not replays(started.code_version):
            raise ValueError(f"the run was started by witness {started.code_version}, whose steps this "
                             f"release ({__version__}) does not reproduce: resume it with that release")
        check_task_source(manifest["task"], manifest.get("task_source"))
        # the rest of the run trains where its start did (a GPU run resumes on the GPU), with the same
        # kernels: a run whose steps came from two kinds of hardware would replay on neither
        if started.torch_version != torch_version():
            raise ValueError(f"the run was started with torch {started.torch_version}; this is torch "
                             f"{torch_version()}: resume it with the torch release that started it")
        kind = started.device["kind"]
        here = device_info(deterministic_device(kind), "compiler" in started.device)
        if not same_hardware(started.device, here):
            raise ValueError(f"the run was started on {describe_device(started.device)}; this is "
                             f"{describe_device(here)}: resume it on the same hardware")
        task = build_task(manifest["task"], manifest["task_config"])
        # the run's own thread count: a thread-dependent kernel would otherwise change its bits
        torch.set_num_threads(bounded_threads(threads or manifest["threads"]))
        records = [parse_canonical_json(line) for line in lines[1:]]
        ended = bool(records) and records[-1]["type"] == "end"
        # a witnessed run killed while its last windows waited for their rounds is finished by a resume:
        # its journal of cosigned checkpoints stays until every window is kept
        if ended and not (started.online is not None and (out / COSIGNED).exists()):
            raise ValueError(f"the run in {out} is already complete")
        intact = [0]
        steps = 0
        for i, rec in enumerate(records):
            if rec.get("type") != "step" or rec.get("step") != i:
                break
            steps = i + 1
            if "checkpoint_sha256" in rec:
                path = out / checkpoint_name(i + 1)
                if path.exists() and file_sha256(path).hex() == rec["checkpoint_sha256"]:
                    intact.append(i + 1)
        heads = [SignedTreeHead.from_json(parse_canonical_json(line)) for line in read_lines(out / HEADS)]
        signed = max((h.size for h in heads), default=1)  # records a head signed stay, whatever happens
        if signed > steps + 1 + ended:
            raise ValueError("a signed head covers records that are not in the log; cannot resume")
        session = TrainingSession(task, bytes.fromhex(manifest["run_seed"]), manifest["dataset_size"], device=kind)
        online = None
        if started.online is None and beacon is not None:
            raise ValueError("the run was started without online challenges; it cannot take them from the middle")
        if started.online is not None:
            if beacon is None:
                raise ValueError("the run takes online challenges: resume it with its beacon")
            if hasattr(beacon, "use_key"):
                beacon.use_key(key)
            spec = OnlineSpec(**{"chunks": 0} | started.online)  # (a run without chunks names none)
            layout = ChunkLayout.of_model(session.model, spec.chunk_bytes) if spec.chunks else None
            online = OnlineChallenges(out, spec, beacon, RunLog(lines[:signed]), started.steps_planned,
                                      task.dataset(), started.checkpoint_every, layout)
            online.load()
        last = max(signed - 1, intact[-1])  # steps kept in the log
        limit = min(last, online.first_needed()) if online is not None else last
        resume_at = max(c for c in intact if c <= limit)
        keep = last + 1
        truncate_lines(out / LOG, keep)
        truncate_lines(out / HEADS, len(heads))
        for f in (out / CHECKPOINTS).iterdir():
            if partial_write(f"{CHECKPOINTS}/{f.name}") or int(f.name.split(".")[0]) > last:
                f.unlink()
        for f in (out / ONLINE).glob("*/*"):  # a selected state or samples file the crash cut short
            if partial_write(f.relative_to(out).as_posix()):
                f.unlink()
        load_state(session.model, session.optimizer, read_checkpoint(out / checkpoint_name(resume_at)))
        log = RunLog(lines[:keep])
        rec = cls(task, out, key, session, BundleWriter(out, create=False), log, manifest, resume_at, on_head, online)
        rec._old_heads = {h.size: h for h in heads}
        if online is not None:
            online.log = log
            online.keep(resume_at, state_tensors(session.model, session.optimizer))
        if self_check and manifest.get("world_size", 1) == 1 and manifest.get("parallelism", "none") == "none":
            # a resumed run is checked as a new one is: its first step here, sampled later ones, every rate
            rec.self_check = SelfCheck(rec, [resume_at], self_check_share)
            rec.self_check.prepare(resume_at)
        return rec

    @property
    def _rounds(self) -> bool:
        """Whether the records closing a window name its drand round (witnessed windows)."""
        return self.online is not None and hasattr(self.online.link, "next_round")

    def _online(self, spec: OnlineSpec, beacon: BeaconLink) -> OnlineChallenges:
        if hasattr(beacon, "use_key"):
            beacon.use_key(self.key)  # type: ignore[attr-defined] - checkpoints are notes the run's key signs
        # named as in the state: a distributed session's unwrapped module, not its DDP wrapper
        module = getattr(self.session, "module", self.model)
        layout = ChunkLayout.of_model(module, spec.chunk_bytes) if spec.chunks else None
        return OnlineChallenges(self.out, spec, beacon, self.log, self.task.config.steps, self.task.dataset(),
                                self.checkpoint_every, layout)

    # --- what the trainer's loop calls --------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The model being trained."""
        return self.session.model

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

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Its optimizer."""
        return self.session.optimizer

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
        ds = self.task.dataset()
        return self.task.collate([ds.sample_bytes(i) for i in self.batch_indices(step)])

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

    def _within_recipe(self, step: int) -> None:
        if step >= self.task.config.steps:
            raise ValueError(f"step {step} is beyond the recipe: {off_by_one_hint(self.task.config.steps)}")

    def batches(self, source: Callable[..., Any] | Any = None) -> Batches:  # noqa: ANN401 - a loop's own
        """The committed batches, for a loop that uses its own model and optimizer (``model=`` at
        create): ``get_batch = rec.batches(get_batch)`` or ``for x, y in rec.batches(loader)``. Each
        call (or item) is the next committed micro-batch; an evaluation's call goes to ``source``.
        From then on every ``optimizer.step()`` records its step (``witness.record.loop``)."""
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

    def log_step(self, step: int, out: StepOutput, *, fingerprint: Any = None, sketch: list[float] | None = None,
                 state: dict | None = None, live: bool = False, state_root: bytes | Future | None = None) -> None:
        """Append the record of ``step`` (call right after the optimizer stepped).

        A distributed run computes the fingerprint, sketch and (where a state is committed) the
        full state with collectives on every rank and hands them in; a single process lets the
        recorder do it. ``live`` says the handed-in state is the training's own tensors (which
        stay put until the optimizer steps again), not a copy: it may then be hashed off the
        training stream, like the state the recorder takes itself. An FSDP2 run over several ranks
        hands in the ``state_root`` its ranks computed from their shards instead (or a future of
        it, which it settles before the next record), never at a checkpoint.
        """
        self._within_recipe(step)
        entered = time.perf_counter()
        if self._left is not None:
            self.step_seconds += entered - self._left - self._aside  # the loop's own step, between two records
            self.record_seconds += self._aside
        self._aside = 0.0
        try:
            self._log_step(step, out, fingerprint, sketch, state, live, state_root)
            if self.self_check is not None:  # the state just committed: the next step is replayed from it
                self.self_check.prepare(step + 1)
        finally:
            self._left = time.perf_counter()
            self.record_seconds += self._left - entered

    def _log_step(self, step: int, out: StepOutput, fingerprint: Any, sketch: list[float] | None,
                  state: dict | None, live: bool, state_root: bytes | Future | None) -> None:
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
        fp = fingerprint if fingerprint is not None else self.session.fingerprint()
        record: dict[str, Any] = {
            "type": "step",
            "step": step,
            "batch": idx,
            "batch_root": root.hex(),
            "loss": out.loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            "fingerprint": fp.to_json(),
            "sketch": sketch if sketch is not None else self.session.sketch(),
        }
        done = step + 1
        checkpoint = self.checkpoint_due(step)
        self.flush()  # the previous record first: the log keeps step order
        if state_root is not None:
            if self.online is not None:
                raise ValueError("online challenges need the whole state at every step, not a root of shards")
            if not self.state_due(step) or checkpoint:
                raise ValueError("a state root comes with a committed state between checkpoints")
            if isinstance(state_root, Future):
                self._deferred = (record, state_root)
                self.next_step = done
                return
            record["state_hash"] = state_root.hex()
        elif self.state_due(step):
            if state is None:
                state, live = state_tensors(self.model, self.optimizer), True
            later = live and self.overlap and not checkpoint and step >= self._signed
            if self.online is not None and not later:
                tree = self.online.keep(done, state)  # a host copy, before training changes it
                if tree is not None:  # the parameters' chunks, which the window's beta will open
                    record["param_root"] = tree.root.hex()
            if later:
                # the overlapped hash copies the state anyway: into the ring's buffer, when it keeps it
                self._hash_later(record, state, self.online.reserve(done, state) if self.online is not None else None,
                                 done)
                self.next_step = done
                return
            if checkpoint:
                sh, fh = save_checkpoint(self.out / checkpoint_name(done), state, done, self.digest)
                record["state_hash"], record["checkpoint_sha256"] = sh.hex(), fh.hex()
            else:
                record["state_hash"] = state_hash(state, self.digest).hex()
        self._append_step(record)
        self.next_step = done

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
        from .overlap import StateSnapshots

        if self._snapshots is None:
            self._snapshots = StateSnapshots(self.optimizer, self.digest)
            # named as in the state: a distributed session's unwrapped module, not its DDP wrapper
            module = getattr(self.session, "module", self.model)
            self._early = frozenset(f"model.{n}" for n, _ in module.named_buffers())
        reduce = None
        online = self.online
        if online is not None and online.layout is not None and n is not None:
            def reduce(copies: dict) -> tuple[bytes, bytes]:
                tree = online.tree(n, into if into is not None else copies)
                return state_hash(copies, self.digest), tree.root  # type: ignore[union-attr]
        self._deferred = (record, self._snapshots.submit(state, early=self._early, into=into, reduce=reduce))

    def flush(self) -> None:
        """Write the record still waiting for its state hash, if there is one (waits for the hash)."""
        if self._deferred is not None:
            record, pending = self._deferred
            self._deferred = None
            done = pending.result()
            if isinstance(done, tuple):  # the state hash and the parameters' chunk root
                record["state_hash"], record["param_root"] = done[0].hex(), done[1].hex()
            else:
                record["state_hash"] = done.hex()
            self._append_step(record)

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
        if self.self_check is not None:
            self.self_check.close()
            if self.self_check.checked:  # in your own loop too: it ran, at this cost
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
        hint, k = None, None
        if per_step > HINT_OVER and self.state_every == 1 and self.task.config.steps > 1:
            # most of the fixed cost is the hash of the whole state; every K steps it is paid 1/K as often
            k = min(max(2, math.ceil(per_step / HINT_OVER)), self.task.config.steps)
            hint = (f"the recorder's fixed cost is {100 * per_step:.0f}% of a training step ({record:.2f} s against "
                    f"{self.step_seconds:.2f} s of steps), most of it the hash of the whole state at every step: "
                    f"--state-every {k} (Recorder.create(state_every={k})) commits it every {k} steps instead; the "
                    f"cheap audit then replays up to {k} steps a challenge (about {(k + 1) / 2:g} on average, "
                    f"{(k + 1) / 2:g}x its cost now for the same confidence)")
        return {"step_seconds": self.step_seconds, "record_seconds": record, "share": share, "per_step": per_step,
                "state_every_hint": k, "hint": hint}

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

