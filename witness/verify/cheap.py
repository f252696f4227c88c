"""The cheap checks, made in full by every audit: the task and its recipe, the probes, every record's
schedule and data order, the end record, and every checkpoint against its commitments."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .. import REPLAYS_RUNS_OF, __version__, replays
from ..bundle.checkpoint import file_sha256, read_checkpoint
from ..bundle.reader import Bundle
from ..bundle.state import (
    check_aliases,
    model_hash,
    state_distances,
    state_hash,
)
from ..commit.hashing import same
from ..data.dataset import Dataset, sample_hash
from ..data.leaves import DatasetLeaves
from ..errors import MalformedInput, VerificationError
from ..fingerprint.chunks import ChunkLayout
from ..fingerprint.probes import relative_distance
from ..methods.remote import MethodSandbox, RemoteTask
from ..session import TrainingSession, bounded_threads, cpu_cores
from ..task.base import Task
from ..task.ranks import accumulation_replays
from ..task.registry import build_task, check_task_source
from .replay import check_state, limit_for, same_floats
from .usage import committed_leaves


def probes_from_bundle(task: Task, bundle: Bundle) -> bool:
    """Whether the task's probes are the bundle's copy, checked against its committed leaves
    (``task_of``), rather than read by the task from its own data."""
    return task.probes_are_samples and bundle.probes is not None and bundle.leaves is not None


def task_of(bundle: Bundle, box: MethodSandbox | None = None) -> Task:
    """The registered task the manifest names (or the submitted method's, in ``box``), with its recipe
    checked against the manifest."""
    m = bundle.manifest
    if box is not None:
        if m.task_source != box.wheel.source():
            raise MalformedInput(f"the run was not trained with the method {box.wheel.distribution} {box.wheel.version} "
                                 f"(its files hash {box.wheel.files_sha256[:16]}…): the manifest pins "
                                 f"{(m.task_source or {}).get('distribution')} {(m.task_source or {}).get('version')} "
                                 f"({str((m.task_source or {}).get('files_sha256'))[:16]}…)")
        task = RemoteTask(box, m.task_config)
    else:
        check_task_source(m.task, m.task_source)  # exactly the code the run used, or exit 2 with what to install
        try:
            task = build_task(m.task, m.task_config)
        except ValueError as e:
            raise VerificationError(f"the manifest's recipe is not a registered one: {e}", check="manifest") from None
    if task.config_json() != m.task_config:
        raise VerificationError("the manifest's task config is not in canonical form", check="manifest")
    if m.steps_planned != task.config.steps:
        raise VerificationError("steps_planned disagrees with the recipe", check="manifest")
    if probes_from_bundle(task, bundle):
        # the task's probes are its first training samples: the bundle's copy (hash-checked against
        # the manifest) stands in for them, so no audit needs the data to read them, once each is
        # checked against the committed leaves (here, for every caller: an identity check or an
        # evaluation uses the probes too). Without leaves the task reads its own, from its data.
        given = task.with_probes(bundle.read_probes())
        check_probes(bundle, given, committed_leaves(bundle, task), None)
        task = given
    if not same(m.probe_hash, task.probe_hash()):
        raise VerificationError("the committed probe set is not the task's", check="manifest")
    bundle.read_probes()  # a task with probes of its own: the bundle's copy must be the committed one too
    if m.raw["fingerprint_spec"] != task.fingerprint_spec():
        raise VerificationError("the fingerprint spec is not the task's", check="manifest")
    if m.world_size > 1 and (m.parallelism not in ("ddp", "fsdp") or task.config.batch_size % m.world_size):
        raise VerificationError(f"a {m.parallelism} run over {m.world_size} ranks cannot be replayed",
                                check="manifest")
    accum = task.grad_accum
    if not accumulation_replays(accum, m.world_size, m.parallelism):
        # (a loop of its own under DDP accumulates grad_accum / world_size micro-batches a rank: witness.task.ranks)
        raise VerificationError(f"a {m.parallelism} run over {m.world_size} rank(s) with grad_accum {accum} has no "
                                "replay rule: accumulation over ranks is DDP's, with grad_accum a multiple of the "
                                "ranks", check="manifest")
    if not replays(m.code_version):
        # The registered tasks are code: another release may build or step them differently.
        raise MalformedInput(f"the run was recorded by witness {m.code_version}; this is witness {__version__}, "
                             f"which replays runs of {', '.join(REPLAYS_RUNS_OF)} only: replay needs the "
                             f"same task code (install witness {m.code_version})")
    return task


def check_probes(bundle: Bundle, task: Task, leaves: DatasetLeaves | None, dataset: Dataset | None) -> None:
    """A task whose probes are its first training samples: each probe the bundle carries must be that
    sample of the committed dataset (by its hash in the committed leaves, or the local data)."""
    m = bundle.manifest
    if not task.probes_are_samples or bundle.probes is None:
        return
    probes = task.probe_bytes()
    want = min(task.probes, m.dataset_size)
    if len(probes) != want:
        raise VerificationError(f"the bundle carries {len(probes)} probes; the task's are its first {want} samples",
                                check="probes")
    if dataset is None and leaves is None:
        raise MalformedInput("the probes cannot be checked without the dataset's leaves (--leaves FILE)")
    for i, p in enumerate(probes):
        committed = dataset.sample_hash(i) if dataset is not None else leaves.sample_hash(i)
        if not same(sample_hash(p), committed):
            raise VerificationError(f"probe {i} is not sample {i} of the committed dataset", check="probes")


@contextmanager
def use_threads(recorded: int, asked: int | None, notes: list[str] | None = None) -> Iterator[int]:
    """Replay at the run's recorded thread count (a thread-dependent kernel changes bits otherwise),
    bounded to this machine's cores; restore the process's count afterwards."""
    cores = cpu_cores()
    threads = bounded_threads(asked) if asked else min(recorded, cores)
    if threads != recorded and notes is not None:
        why = f"this machine has {cores} core(s)" if not asked else "--threads asked for it"
        notes.append(f"replaying at {threads} thread(s) where the run recorded {recorded} ({why}): a kernel "
                     "whose reduction depends on the thread count can change the last bits; if steps are "
                     f"rejected, verify with --threads {recorded} (on a machine with at least {recorded} cores)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def check_records(bundle: Bundle, task: Task, session: TrainingSession) -> list[str]:
    """Schedule, data order, shapes and stagnation of every step, and the end record's totals."""
    checks = []
    m = bundle.manifest
    init_sketch = tuple(session.sketch())
    fp_len = task.config.fingerprint_dims * len(task.probe_bytes())
    prev_sketch = init_sketch
    for rec in bundle.steps:
        t = rec.step
        if list(rec.batch) != session.batch_indices(t):
            raise VerificationError("the batch is not the one the seed-derived data order gives", step=t, check="data order")
        if rec.lr != session.lr(t):
            raise VerificationError(f"learning rate {rec.lr!r} is not the schedule's {session.lr(t)!r}", step=t, check="schedule")
        if len(rec.sketch) != task.config.sketch_dims or len(rec.probe_loss) != len(task.probe_bytes()) \
                or len(rec.projection) != fp_len:
            raise VerificationError("fingerprint or sketch has the wrong size", step=t, check="record")
        # an fp16 step whose gradients overflowed is skipped by its GradScaler (replay skips it too); a run that
        # diverged keeps NaN weights, whose sketch is NaN from step to step (it stepped: replay shows how)
        skipped = task.precision == "fp16" and not math.isfinite(rec.grad_norm)
        diverged = any(math.isnan(x) for x in rec.sketch)
        if rec.sketch == prev_sketch and rec.lr > 0 and not skipped and not diverged:
            raise VerificationError("the parameters did not change: the optimizer did not step", step=t, check="record")
        prev_sketch = rec.sketch
    if getattr(session, "one_way", False):  # a submitted method's schedule is its own word; replay holds it to it
        checks.append(f"learning rates of all {len(bundle.steps)} steps are the ones the method describes (its own "
                      "word: replay checks the states its code reaches, not the rate it used)")
    else:
        checks.append(f"learning-rate schedule recomputed for all {len(bundle.steps)} steps")
    checks.append(f"data order recomputed from the run seed for all {len(bundle.steps)} steps")
    if bundle.end is not None:
        last = bundle.steps[-1]
        if bundle.end.task is not None and bundle.end.task != m.task:
            raise VerificationError(f"the end record names task {bundle.end.task!r}; the run is {m.task!r}",
                                    check="end")
        if bundle.end.steps != m.steps_planned:
            raise VerificationError(f"the run ended after {bundle.end.steps} of {m.steps_planned} planned steps", check="end")
        if last.state_hash is None or not same(last.state_hash, bundle.end.final_state_hash):
            raise VerificationError("the final state hash is not the last checkpoint's", check="end")
    return checks


def check_checkpoints(bundle: Bundle, session: TrainingSession, exact: bool, thresholds: dict[str, float]) -> list[str]:
    """Every checkpoint: file hash, state hash, and its fingerprint and sketch against the record."""
    m = bundle.manifest
    seeded = session.state()
    init_check: str | None = "initial state regenerated from the seed"
    if not same(state_hash(seeded, m.state_digest), m.init_state_hash):
        if exact:
            raise VerificationError("the initial state is not the one the run seed generates", step=0, check="init")
        init_check = None  # tolerance mode: judged against the initial checkpoint below
    # a chunked run's records commit their parameters' chunk root too: each checkpoint is held to it
    # (version 4's chunks open into the state hash itself)
    layout = ChunkLayout.of_model(session.model, m.online["chunk_bytes"], m.state_shards) \
        if m.chunked and not m.tree else None  # type: ignore[index]
    aliases = session.aliases()  # tied weights, from the task's own model
    for step in bundle.checkpoint_steps():
        sh, fh = bundle.committed_checkpoint(step)  # type: ignore[misc]
        path = bundle.checkpoints[step]
        if not same(file_sha256(path), fh):
            raise VerificationError(f"{path.name} is not the committed checkpoint file", step=step, check="checkpoint")
        tensors = read_checkpoint(path)
        if not same(state_hash(tensors, m.state_digest), sh):
            raise VerificationError(f"{path.name} does not hash to the committed state", step=step, check="checkpoint")
        check_aliases(aliases, tensors, f"the checkpoint {path.name}", step=step)
        if step == 0 and init_check is None:  # first in the loop: the session still holds the seed's state
            init_check = _init_within_tolerance(tensors, seeded, session, thresholds)
        if step > 0 and getattr(session, "one_way", False):
            # a submitted method is shown a committed state only to step from, in the order of the steps
            # (methods.process): its sketch is checked here, its fingerprint where replay starts from it
            _check_sketch(bundle, session.sketch_of(tensors), step, exact, thresholds)
        elif step > 0:
            session.load(tensors, step)
            check_state(bundle, session, step, exact, thresholds)
            leaves = bundle.steps[step - 1].state_leaves
            if leaves is not None and leaves != len(tensors):  # version 4: where its openings put each leaf
                raise VerificationError(f"{path.name}: its record commits a state of {leaves} tensors, and it holds "
                                        f"{len(tensors)}", step=step, check="checkpoint")
            root = bundle.steps[step - 1].param_root
            if root is not None and not same(layout.root(tensors), root):  # type: ignore[union-attr]
                raise VerificationError(f"{path.name}: its record's param_root is not the chunk root of its parameters",
                                        step=step, check="checkpoint")
        if bundle.end is not None and step == len(bundle.steps) and not same(model_hash(tensors, m.state_digest),
                                                                             bundle.end.final_model_hash):
            raise VerificationError("the final model hash is not that of the final checkpoint's model", check="end")
    if init_check is None:  # fail closed: the reader refuses a bundle without its initial checkpoint
        raise MalformedInput("the bundle has no initial checkpoint to compare the seed's state with")
    return [f"{init_check}; {len(bundle.checkpoints)} checkpoint(s) hashed and fingerprinted"]


def _check_sketch(bundle: Bundle, sketch: list[float], step: int, exact: bool, thresholds: dict[str, float]) -> None:
    """A checkpoint's parameter sketch against its record's (exactly, or within the threshold)."""
    want = bundle.steps[step - 1].sketch
    if not (same_floats(sketch, want) if exact else relative_distance(sketch, want) <= thresholds["sketch"]):
        raise VerificationError("the checkpoint does not match the recorded sketch", step=step - 1, check="state")


def _init_within_tolerance(committed: dict[str, torch.Tensor], seeded: dict[str, torch.Tensor],
                           session: TrainingSession, thresholds: dict[str, float]) -> str:
    """Tolerance mode: the committed initial state (the initial checkpoint, its hashes checked) within
    the thresholds of the one the seed gives here.

    Another CPU draws the initial weights with other kernels (randn's last bits differ), so only
    the distance can be asked for; replays start from the committed state.
    """
    parameters = {f"model.{n}" for n in session.parameter_names()}
    try:
        d = state_distances(committed, seeded, parameters)
    except ValueError as e:
        raise VerificationError(f"the initial state is not the one the run seed generates: {e}", step=0,
                                check="init") from None
    for k, v in d.items():
        limit = limit_for(k, thresholds)
        if not v <= limit:
            raise VerificationError(f"the initial state is not the one the run seed generates: {k} distance "
                                    f"{v:.3g} exceeds the threshold {limit:.3g}", step=0, check="init")
    worst = max(d.values(), default=0.0)
    return f"initial state within tolerance of the one the seed gives here (largest distance {worst:.2g})"
