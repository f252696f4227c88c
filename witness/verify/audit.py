"""The audit: every cheap check in full, then random replay challenges; a verdict or an error."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from .. import REPLAYS_RUNS_OF, __version__, replays
from ..bundle.checkpoint import file_sha256, read_checkpoint
from ..bundle.reader import Bundle, as_bundle
from ..bundle.state import load_state, model_hash, state_distances, state_hash, state_tensors
from ..commit.beacon import online_bound
from ..commit.hashing import same
from ..commit.signing import SignedTreeHead, key_fingerprint, public_key_from_hex
from ..data.dataset import Dataset, sample_hash
from ..data.leaves import DatasetLeaves
from ..data.order import derive_run_seed
from ..errors import MalformedInput, RunRejected, VerificationError
from ..session import (
    TrainingSession,
    bounded_threads,
    cpu_cores,
    describe_device,
    deterministic_device,
    device_info,
    same_hardware,
    torch_version,
)
from ..task.base import Task
from ..task.registry import build_task, check_task_source
from .challenges import ReplayChallenge, challenges_needed, detection_probability, draw_challenges
from .finddata import committed_dataset
from .online import OnlineSamples, OnlineStates, check_statements
from .replay import (
    DEFAULT_THRESHOLDS,
    CheckpointStates,
    LocalSamples,
    Replayer,
    SegmentPlan,
    check_state,
    check_thresholds,
    limit_for,
)
from .response import MissingState, Response, ResponseSamples
from .usage import check_data_usage, committed_leaves
from .verdict import ChallengeResult, Verdict

DEFAULT_CONFIDENCE = 0.99
DEFAULT_BAD_FRACTION = 0.05


def _probes_from_bundle(task: Task, bundle: Bundle) -> bool:
    """Whether the task's probes are the bundle's copy, checked against its committed leaves
    (``task_of``), rather than read by the task from its own data."""
    return task.probes_are_samples and bundle.probes is not None and bundle.leaves is not None


def task_of(bundle: Bundle) -> Task:
    """The registered task the manifest names, with its recipe checked against the manifest."""
    m = bundle.manifest
    check_task_source(m.task, m.task_source)  # exactly the code the run used, or exit 2 with what to install
    try:
        task = build_task(m.task, m.task_config)
    except ValueError as e:
        raise VerificationError(f"the manifest's recipe is not a registered one: {e}", check="manifest") from None
    if task.config_json() != m.task_config:
        raise VerificationError("the manifest's task config is not in canonical form", check="manifest")
    if m.steps_planned != task.config.steps:
        raise VerificationError("steps_planned disagrees with the recipe", check="manifest")
    if _probes_from_bundle(task, bundle):
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
        # an fp16 step whose gradients overflowed is skipped by its GradScaler (replay skips it too)
        skipped = task.precision == "fp16" and not math.isfinite(rec.grad_norm)
        if rec.sketch == prev_sketch and rec.lr > 0 and not skipped:
            raise VerificationError("the parameters did not change: the optimizer did not step", step=t, check="record")
        prev_sketch = rec.sketch
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
    seeded = state_tensors(session.model, session.optimizer)
    init_check: str | None = "initial state regenerated from the seed"
    if not same(state_hash(seeded, m.state_digest), m.init_state_hash):
        if exact:
            raise VerificationError("the initial state is not the one the run seed generates", step=0, check="init")
        init_check = None  # tolerance mode: judged against the initial checkpoint below
    for step in bundle.checkpoint_steps():
        sh, fh = bundle.committed_checkpoint(step)  # type: ignore[misc]
        path = bundle.checkpoints[step]
        if not same(file_sha256(path), fh):
            raise VerificationError(f"{path.name} is not the committed checkpoint file", step=step, check="checkpoint")
        tensors = read_checkpoint(path)
        if not same(state_hash(tensors, m.state_digest), sh):
            raise VerificationError(f"{path.name} does not hash to the committed state", step=step, check="checkpoint")
        if step == 0 and init_check is None:  # first in the loop: the session still holds the seed's state
            init_check = _init_within_tolerance(tensors, seeded, session, thresholds)
        if step > 0:
            load_state(session.model, session.optimizer, tensors)
            check_state(bundle, session, step, exact, thresholds)
        if bundle.end is not None and step == len(bundle.steps) and not same(model_hash(tensors, m.state_digest),
                                                                             bundle.end.final_model_hash):
            raise VerificationError("the final model hash is not that of the final checkpoint's model", check="end")
    if init_check is None:  # fail closed: the reader refuses a bundle without its initial checkpoint
        raise MalformedInput("the bundle has no initial checkpoint to compare the seed's state with")
    return [f"{init_check}; {len(bundle.checkpoints)} checkpoint(s) hashed and fingerprinted"]


def _init_within_tolerance(committed: dict[str, torch.Tensor], seeded: dict[str, torch.Tensor],
                           session: TrainingSession, thresholds: dict[str, float]) -> str:
    """Tolerance mode: the committed initial state (the initial checkpoint, its hashes checked) within
    the thresholds of the one the seed gives here.

    Another CPU draws the initial weights with other kernels (randn's last bits differ), so only
    the distance can be asked for; replays start from the committed state.
    """
    parameters = {f"model.{n}" for n, _ in session.model.named_parameters()}
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


def verify_bundle(
    path: str | os.PathLike | Bundle,
    *,
    challenges: int | None = None,
    confidence: float | None = None,
    bad_fraction: float | None = None,
    nonce: bytes | None = None,
    mode: str = "offline",
    response: str | os.PathLike | Response | None = None,
    exact: bool = True,
    thresholds: dict[str, float] | None = None,
    length: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    public_key: str | None = None,
    published_heads: list[SignedTreeHead] | None = None,
    ticket: bytes | None = None,
    leaves: str | os.PathLike | None = None,
    beacon_key: str | None = None,
    progress: bool = False,
    skip: Collection[int] = (),
) -> Verdict:
    """Audit a bundle. Returns an accepted verdict or raises a ``VerificationError``.

    Replay is bit-exact unless the *verifier* asks for tolerance (``exact=False``: replay on
    other hardware), whatever the bundle says about itself. ``threads`` defaults to the run's
    recorded count (bounded to this machine's cores).

    ``published_heads`` are tree heads the trainer published earlier (to a leaderboard, in a
    paper): the log must extend every one of them, so it cannot have been rewritten since.
    ``ticket`` is the r a ticket issuer handed out: the run seed must be derived from it.
    ``leaves`` is the dataset's leaves file where the bundle carries none (a large corpus's,
    published once): every batch root and the used-data trees are checked against it in full.

    ``mode="online"`` replays the steps that the statements of the beacon whose key is
    ``beacon_key`` (hex; the verifier's choice, never the bundle's) selected while the run trained,
    from the states the trainer kept for them; ``challenges`` and ``nonce`` play no part. ``skip``
    names selected steps not to replay now: a leaderboard replayed them from the same commitments
    as their states arrived while the run trained (or replays them when their states arrive).
    """
    started = time.perf_counter()
    if mode not in ("offline", "interactive", "online"):
        raise MalformedInput(f"unknown mode {mode!r}")
    if (mode == "online") != (beacon_key is not None):
        raise MalformedInput("online mode needs the key of the beacon the verifier trusts (--beacon-key), and "
                             "only online mode takes one")
    f = DEFAULT_BAD_FRACTION if bad_fraction is None else bad_fraction
    check_thresholds(thresholds or {})
    if challenges is None:
        challenges = challenges_needed(confidence or DEFAULT_CONFIDENCE, f)
    if challenges < 1 or length < 1:
        raise MalformedInput("need at least one challenge of at least one step")
    nonce = os.urandom(16) if nonce is None else nonce

    bundle = as_bundle(path, public_key)
    if mode == "interactive":  # read (strictly) before any work: an unreadable response is unusable input
        if response is None:
            raise MalformedInput("interactive mode needs the trainer's response (witness respond)")
        response = response if isinstance(response, Response) else Response(response)
    m = bundle.manifest
    task = task_of(bundle)
    notes = list(bundle.notes)
    if m.torch_version != torch_version():
        if exact:
            raise MalformedInput(f"the run was recorded with torch {m.torch_version}; this machine has torch "
                                 f"{torch_version()}: exact replay needs the same kernels (install torch=="
                                 f"{m.torch_version}, or verify with --tolerance)")
        notes.append(f"recorded with torch {m.torch_version}, replayed with {torch_version()}")
    for h in published_heads or []:
        h.verify(public_key_from_hex(m.public_key))
        if not bundle.log.extends(h.size, h.root):
            raise VerificationError(f"the log does not extend the published tree head of size {h.size}: "
                                    "it was rewritten after that head was published", check="log")
    checks = [f"the log extends {len(published_heads)} published tree head(s)"] if published_heads else []
    here = device_info(deterministic_device(device), task.compiles)
    if not same_hardware(m.device, here):
        if exact:
            raise MalformedInput(f"the run was recorded on {describe_device(m.device)}; this replay would run on "
                                 f"{describe_device(here)}: bit-exact replay needs the same hardware (replay there, "
                                 f"with --device {m.device['kind']}, or verify with --tolerance)")
        notes.append(f"recorded on {describe_device(m.device)}, replayed on {describe_device(here)} in tolerance mode")
    elif exact:
        checks.append(f"replayed on the run's own hardware, {describe_device(here)}: bit for bit")
        if m.device["kind"] == "cpu" and "kernels" not in m.device:
            notes.append("the run did not record its CPU's kernel choice (witness before 0.4.0): exact replay "
                         "assumes this CPU picks the same kernels; a CPU that picks others can fail honest steps, "
                         "which --tolerance tells apart")
    if not same(derive_run_seed(m.data_root, m.r), m.run_seed):
        raise VerificationError("the run seed is not H(data root || r)", check="seed")
    if ticket is not None:
        if m.r_source != "ticket" or not same(m.r, ticket):
            raise VerificationError("the run seed is not derived from the ticket issued for it", check="seed")
        checks.append("r is the issued ticket")
    elif m.r_source == "ticket":
        notes.append("the manifest says r came from a ticket; only its issuer can check that (--ticket)")
    checks += ["signatures and log consistency of every signed tree head", "run seed = H(data root || r)"]

    with use_threads(m.threads, threads, notes) as used_threads:
        return _audit(bundle, task, mode, response, exact, thresholds, length, challenges, f, nonce, notes,
                      checks, used_threads, started, progress, confidence, device, leaves, beacon_key, set(skip))


def _audit(bundle: Bundle, task: Task, mode: str, response: str | os.PathLike | Response | None, exact: bool,
           thresholds: dict[str, float] | None, length: int, challenges: int, f: float, nonce: bytes,
           notes: list[str], checks: list[str], threads: int, started: float, progress: bool,
           confidence: float | None, device: str, leaves_path: str | os.PathLike | None,
           beacon_key: str | None, skip: set[int]) -> Verdict:
    m = bundle.manifest
    local: LocalSamples | None = None
    online = check_statements(bundle, beacon_key) if mode == "online" else None
    if mode == "offline":
        dataset, found = committed_dataset(task, m)
        if found is not None:
            notes.append(found)
        local = LocalSamples(dataset)
    session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.parallelism, device)
    checks += check_records(bundle, task, session)
    leaves = committed_leaves(bundle, task, local.dataset if local else None, leaves_path)
    checks += check_data_usage(bundle, task, leaves, local.dataset if local else None)
    if _probes_from_bundle(task, bundle):
        checks.append(f"the {len(task.probe_bytes())} probes the bundle carries are the first samples of the committed "
                      "dataset")
    if leaves is None and local is None and bundle.complete:
        notes.append("the run was recorded before its dataset's leaves were committed (witness 0.4 and "
                     "earlier): its used-data trees are checked only at the replayed samples")
    limits = dict(DEFAULT_THRESHOLDS, **(thresholds or {}))
    checks += check_checkpoints(bundle, session, exact, limits)

    n = len(bundle.steps)
    if online is None:
        drawn = draw_challenges(bundle.final_head, nonce, n, challenges, length)
        bound = detection_probability(f, len(drawn), n)
    else:
        drawn = [ReplayChallenge(t, 1) for t in online.selected if t not in skip]
        bound = online_bound(online.p, f, n, len(online.unaudited))
        checks.append(online.describe())
        if skip & set(online.selected):
            checks.append(f"{len(skip & set(online.selected))} selected step(s) replayed apart from this audit, "
                          "as their states arrived")
        if online.unaudited:
            notes.append(f"steps {online.unaudited.start}..{online.unaudited.stop - 1} have no beacon statement: not "
                         "audited online (the bound counts them as bad steps the audit cannot see)")
    verdict = Verdict(
        accepted=False, mode=mode, exact=exact, task=m.task, steps=n, complete=bundle.complete,
        signer=key_fingerprint(m.public_key), challenges=len(drawn) if online is None else len(online.selected),
        bad_fraction=f,
        detection_probability=bound, nonce=nonce.hex() if online is None else "",
        notes=notes, checks=checks, thresholds={} if exact else limits,
        state_every=m.state_every, threads=threads, confidence=confidence,
    )
    if online is not None:
        verdict.online = {"beacon": online.beacon, "p": online.p, "every": online.every, "windows": online.windows,
                          "selected": online.selected, "covered": online.covered,
                          "unaudited": len(online.unaudited), "final": online.final}
    if local is None and bundle.complete and mode != "offline":
        verdict.checks.append("every replayed sample is the committed dataset's, with its documents")
    if not bundle.complete:
        verdict.notes.append(f"incomplete run: {n} of {m.steps_planned} planned steps are signed; verified as a {n}-step run")

    committed, checkpoints = bundle.state_steps(), bundle.checkpoint_steps()
    if mode == "offline":
        # Offline replay starts from checkpoints; exact replay may end on any committed hash, while
        # tolerance mode needs the committed tensors at the end, so it replays to a checkpoint.
        plan = SegmentPlan(checkpoints, committed if exact else checkpoints)
        states: CheckpointStates | OnlineStates = CheckpointStates(bundle)
        if bundle.missing_checkpoints:
            # An online run that left out checkpoints: replay starts from any state it holds (the
            # selected steps' states are committed by hash, as every state of an online run is).
            held = bundle.held_states()
            plan, states = SegmentPlan(held, committed if exact else held), OnlineStates(bundle)
        replayer = Replayer(bundle, task, local, states, plan, exact, limits, device)  # type: ignore[arg-type]
    elif mode == "online":
        if leaves is None:
            raise MalformedInput("the online audit needs the dataset's leaves (the bundle's dataset.leaves or "
                                 "--leaves), which the samples kept for the selected steps are checked against")
        source = OnlineSamples(bundle, leaves, task.document_rule)
        # every state is committed (the manifest says so for an online run): a selected step replays alone
        replayer = Replayer(bundle, task, source, OnlineStates(bundle), SegmentPlan(committed, committed), exact,
                            limits, device)
    else:
        resp = response
        assert isinstance(resp, Response)
        if resp.head_root != bundle.final_head.root or resp.head_size != bundle.final_head.size:
            raise MalformedInput("the response was made for another tree head")
        samples = ResponseSamples(resp, m.data_root, m.dataset_size, bundle.end, leaves, task.document_rule)
        replayer = Replayer(bundle, task, samples, resp, SegmentPlan(committed, committed), exact, limits, device)

    for ch in tqdm(drawn, desc="replay challenges", unit="challenge", disable=not progress):
        result = ChallengeResult(ch.step, ch.length, passed=True, replayed_steps=0)
        before = replayer.steps_run
        try:
            replayer.challenge(ch.step, ch.length, result)
        except MalformedInput:
            raise
        except VerificationError as e:
            result.passed = False
            result.failure = str(e)
            if verdict.failures and isinstance(e, MissingState):
                # after a failed segment, replay cannot go on from it: the honest response does not
                # hold the state this segment would have been reached from (witness respond ships
                # only the states an accepted audit reads)
                result.failure = "not replayed: an earlier segment failed, and the response holds no state to start "\
                                 "this one from"
                verdict.results.append(result)
                continue
            if threads != m.threads and exact:
                result.failure += f" (replayed at {threads} thread(s); the run recorded {m.threads})"
            if result.failure not in verdict.failures:  # replays of one segment meet the same bad step
                verdict.failures.append(result.failure)
        result.replayed_steps = replayer.steps_run - before
        verdict.results.append(result)

    verdict.replayed_steps = replayer.steps_run
    verdict.replay_flops = replayer.steps_run * task.flops_per_step()
    verdict.training_flops = n * task.flops_per_step()
    verdict.verify_seconds = time.perf_counter() - started
    verdict.accepted = not verdict.failures
    if verdict.failures:
        raise RunRejected(verdict.failures, verdict)
    return verdict


def default_response_dir(bundle_dir: str | os.PathLike) -> Path:
    """Where ``witness respond`` writes by default."""
    return Path(str(bundle_dir).rstrip("/") + ".response")
