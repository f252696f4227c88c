"""The audit: every cheap check in full, then random replay challenges; a verdict or an error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..bundle.checkpoint import (
    file_sha256,
    load_state,
    model_hash,
    read_checkpoint,
    state_hash,
    state_tensors,
)
from ..bundle.reader import Bundle, as_bundle
from ..commit.hashing import same
from ..commit.signing import SignedTreeHead, key_fingerprint, public_key_from_hex
from ..data.dataset import Dataset
from ..data.order import derive_run_seed
from ..data.usage import UsageCommitment
from ..errors import MalformedInput, RunRejected, VerificationError
from ..record.session import TrainingSession
from ..task.base import Task
from ..task.registry import build_task
from .challenges import ReplayChallenge, challenges_needed, detection_probability, draw_challenges
from .replay import DEFAULT_THRESHOLDS, SUM_ORDER_THRESHOLDS, LocalSamples, Replayer, check_state
from .response import Response, ResponseSamples
from .verdict import ChallengeResult, Verdict

DEFAULT_CONFIDENCE = 0.99
DEFAULT_BAD_FRACTION = 0.05


def task_of(bundle: Bundle) -> Task:
    """The registered task the manifest names, with its recipe checked against the manifest."""
    m = bundle.manifest
    try:
        task = build_task(m.task, m.task_config)
    except ValueError as e:
        raise VerificationError(f"the manifest's recipe is not a registered one: {e}", check="manifest") from None
    if task.config_json() != m.task_config:
        raise VerificationError("the manifest's task config is not in canonical form", check="manifest")
    if m.steps_planned != task.config.steps:
        raise VerificationError("steps_planned disagrees with the recipe", check="manifest")
    if not same(m.probe_hash, task.probe_hash()):
        raise VerificationError("the committed probe set is not the task's", check="manifest")
    if m.raw["fingerprint_spec"] != task.fingerprint_spec():
        raise VerificationError("the fingerprint spec is not the task's", check="manifest")
    if m.world_size > 1 and (m.raw["parallelism"] not in ("ddp", "fsdp") or task.config.batch_size % m.world_size):
        raise VerificationError(f"a {m.raw['parallelism']} run over {m.world_size} ranks cannot be replayed",
                                check="manifest")
    if m.world_size == 1 and m.raw["parallelism"] != "none":
        raise VerificationError("a single-process run names a parallelism", check="manifest")
    return task


def check_records(bundle: Bundle, task: Task, session: TrainingSession, local: LocalSamples | None) -> list[str]:
    """Schedule, data order, batch roots (with local data), shapes and stagnation: every step."""
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
        if rec.sketch == prev_sketch and rec.lr > 0:
            raise VerificationError("the parameters did not change: the optimizer did not step", step=t, check="record")
        prev_sketch = rec.sketch
        if local is not None and not same(local.dataset.batch_root(rec.batch), rec.batch_root):
            raise VerificationError("the batch root is not that of the committed samples", step=t, check="data")
    checks.append(f"learning-rate schedule recomputed for all {len(bundle.steps)} steps")
    checks.append(f"data order recomputed from the run seed for all {len(bundle.steps)} steps")
    if local is not None:
        checks.append(f"batch roots recomputed from the dataset for all {len(bundle.steps)} steps")
    if bundle.end is not None:
        last = bundle.steps[-1]
        if bundle.end.steps != m.steps_planned:
            raise VerificationError(f"the run ended after {bundle.end.steps} of {m.steps_planned} planned steps", check="end")
        if last.state_hash is None or not same(last.state_hash, bundle.end.final_state_hash):
            raise VerificationError("the final state hash is not the last checkpoint's", check="end")
        if local is not None:
            check_usage(bundle, local.dataset)
            checks.append(f"used-sample and used-document trees recomputed from all {len(bundle.steps)} batches")
    return checks


def check_usage(bundle: Bundle, dataset: Dataset) -> UsageCommitment:
    """The end record's used-sample and used-document trees must be those of the logged batches."""
    usage = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps))
    end = bundle.end
    if end is None:
        raise MalformedInput("the run is not finished: no end record commits the used data")
    if end.document_rule != usage.document_rule:
        raise VerificationError("the end record's document rule is not the dataset's", check="data usage")
    for name, tree, committed in (("sample", usage.samples, end.used_samples),
                                  ("document", usage.documents, end.used_documents)):
        if tree.size != committed.size or not same(tree.root, committed.root):
            raise VerificationError(
                f"the committed used-{name} tree is not the one the logged batches give "
                f"({committed.size} committed, {tree.size} used)", check="data usage")
    return usage


def check_checkpoints(bundle: Bundle, session: TrainingSession, exact: bool, thresholds: dict[str, float]) -> list[str]:
    """Every checkpoint: file hash, state hash, and its fingerprint and sketch against the record."""
    m = bundle.manifest
    if not same(state_hash(state_tensors(session.model, session.optimizer)), m.init_state_hash):
        raise VerificationError("the initial state is not the one the run seed generates", step=0, check="init")
    for step in bundle.checkpoint_steps():
        sh, fh = bundle.committed_checkpoint(step)  # type: ignore[misc]
        path = bundle.checkpoints[step]
        if not same(file_sha256(path), fh):
            raise VerificationError(f"{path.name} is not the committed checkpoint file", step=step, check="checkpoint")
        tensors = read_checkpoint(path)
        if not same(state_hash(tensors), sh):
            raise VerificationError(f"{path.name} does not hash to the committed state", step=step, check="checkpoint")
        if step > 0:
            load_state(session.model, session.optimizer, tensors)
            check_state(bundle, session, step, exact, thresholds)
        if bundle.end is not None and step == len(bundle.steps) and not same(model_hash(tensors),
                                                                             bundle.end.final_model_hash):
            raise VerificationError("the final model hash is not that of the final checkpoint's model", check="end")
    return [f"initial state regenerated from the seed; {len(bundle.checkpoints)} checkpoint(s) hashed and fingerprinted"]


def verify_bundle(
    path: str | os.PathLike | Bundle,
    *,
    challenges: int | None = None,
    confidence: float | None = None,
    bad_fraction: float | None = None,
    nonce: bytes | None = None,
    mode: str = "offline",
    response: str | os.PathLike | None = None,
    exact: bool | None = None,
    thresholds: dict[str, float] | None = None,
    length: int = 1,
    threads: int | None = None,
    public_key: str | None = None,
    published_heads: list[SignedTreeHead] | None = None,
    progress: bool = False,
) -> Verdict:
    """Audit a bundle. Returns an accepted verdict or raises a ``VerificationError``.

    ``exact=None`` chooses: bit-exact replay, except for runs over more than 2 ranks, whose
    collectives sum in an order one process cannot reproduce bit for bit; those replay in
    tolerance mode with thresholds calibrated for that summation noise.

    ``published_heads`` are tree heads the trainer published earlier (to a leaderboard, in a
    paper): the log must extend every one of them, so it cannot have been rewritten since.
    """
    started = time.perf_counter()
    if mode not in ("offline", "interactive"):
        raise MalformedInput(f"unknown mode {mode!r}")
    if threads:
        torch.set_num_threads(threads)
    f = DEFAULT_BAD_FRACTION if bad_fraction is None else bad_fraction
    if challenges is None:
        challenges = challenges_needed(confidence or DEFAULT_CONFIDENCE, f)
    if challenges < 1 or length < 1:
        raise MalformedInput("need at least one challenge of at least one step")
    nonce = os.urandom(16) if nonce is None else nonce

    bundle = as_bundle(path, public_key)
    m = bundle.manifest
    task = task_of(bundle)
    # One process sums the ranks' gradients in rank order. For 2 ranks that is the collective's
    # sum (a + b = b + a), so replay is bit-exact, for DDP and (with the shard-wise norm) FSDP2.
    # With more ranks the collectives add chunk by chunk in their own orders: the last bits
    # differ, so such runs replay in tolerance mode, and the verdict says so.
    fsdp_many_ranks = m.raw["parallelism"] == "fsdp" and m.world_size > 2
    auto_tolerance = exact is None and m.world_size > 2
    exact = not auto_tolerance if exact is None else exact
    for h in published_heads or []:
        h.verify(public_key_from_hex(m.public_key))
        if not bundle.log.extends(h.size, h.root):
            raise VerificationError(f"the log does not extend the published tree head of size {h.size}: "
                                    "it was rewritten after that head was published", check="log")
    checks = [f"the log extends {len(published_heads)} published tree head(s)"] if published_heads else []
    if not same(derive_run_seed(m.data_root, m.r), m.run_seed):
        raise VerificationError("the run seed is not H(data root || r)", check="seed")
    checks += ["signatures and log consistency of every signed tree head", "run seed = H(data root || r)"]

    local: LocalSamples | None = None
    if mode == "offline":
        dataset = task.dataset()
        if not same(dataset.root, m.data_root) or len(dataset) != m.dataset_size:
            raise MalformedInput(
                f"the committed dataset (root {m.data_root.hex()[:16]}…) is not the one here "
                f"(root {dataset.root.hex()[:16]}…); verify with --mode interactive and the trainer's response"
            )
        local = LocalSamples(dataset)
    session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.raw["parallelism"])
    checks += check_records(bundle, task, session, local)
    base = SUM_ORDER_THRESHOLDS if auto_tolerance else DEFAULT_THRESHOLDS
    limits = dict(base, **(thresholds or {}))
    checks += check_checkpoints(bundle, session, exact, limits)

    n = len(bundle.steps)
    drawn = draw_challenges(bundle.final_head, nonce, n, challenges, length)
    verdict = Verdict(
        accepted=False, mode=mode, exact=exact, task=m.task, steps=n, complete=bundle.complete,
        signer=key_fingerprint(m.public_key), challenges=len(drawn), bad_fraction=f,
        detection_probability=detection_probability(f, len(drawn), n), nonce=nonce.hex(),
        notes=list(bundle.notes), checks=checks,
        thresholds={} if exact else limits,
    )
    if auto_tolerance:
        verdict.notes.append(f"{m.raw['parallelism'].upper()} run over {m.world_size} ranks: the collectives' "
                             "cross-rank sums are not bit-reproducible on one process, so replay compares "
                             "within the thresholds below")
    elif fsdp_many_ranks and exact:
        verdict.notes.append("FSDP run: the reported gradient norm is compared within 1e-6 (its cross-rank "
                             "sum may round differently)")
    if local is None and bundle.complete:
        verdict.notes.append("used-data trees not recomputed: interactive mode has no local copy of the dataset")
    if not bundle.complete:
        verdict.notes.append(f"incomplete run: {n} of {m.steps_planned} planned steps are signed; verified as a {n}-step run")

    norm_rtol = 1e-6 if fsdp_many_ranks else 0.0
    if mode == "offline":
        replayer = Replayer(bundle, task, local, exact, limits, norm_rtol)  # type: ignore[arg-type]
        run = _offline
    else:
        if response is None:
            raise MalformedInput("interactive mode needs the trainer's response (witness respond)")
        resp = Response(response)
        if resp.head_root != bundle.final_head.root or resp.head_size != bundle.final_head.size:
            raise MalformedInput("the response was made for another tree head")
        samples = ResponseSamples(resp, m.data_root, m.dataset_size)
        replayer = Replayer(bundle, task, samples, exact, limits, norm_rtol)
        run = _interactive(resp)

    for ch in tqdm(drawn, desc="replay challenges", unit="challenge", disable=not progress):
        result = ChallengeResult(ch.step, ch.length, passed=True, replayed_steps=0)
        before = replayer.steps_run
        try:
            run(replayer, bundle, ch, result)
        except MalformedInput:
            raise
        except VerificationError as e:
            result.passed = False
            result.failure = str(e)
            if str(e) not in verdict.failures:  # offline replays of one interval meet the same bad step
                verdict.failures.append(str(e))
            replayer.position = None
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


def _offline(replayer: Replayer, bundle: Bundle, ch: ReplayChallenge, result: ChallengeResult) -> None:
    """Rebuild the state at the challenged step from the checkpoint before it, then replay."""
    start = max(c for c in bundle.checkpoint_steps() if c <= ch.step)
    pos = replayer.position
    if pos is None or pos < start or pos > ch.step:
        replayer.load(start, read_checkpoint(bundle.checkpoints[start]))
    while replayer.position < ch.step + ch.length:  # type: ignore[operator]
        replayer.advance(result)


def _interactive(resp: Response):
    def run(replayer: Replayer, bundle: Bundle, ch: ReplayChallenge, result: ChallengeResult) -> None:
        """Take the trainer's state at the challenged step, check it against the record, replay."""
        tensors = resp.state(ch.step)
        committed = bundle.committed_checkpoint(ch.step)
        if committed is not None and not same(state_hash(tensors), committed[0]):
            raise VerificationError("supplied state is not the committed checkpoint", step=ch.step, check="state")
        replayer.load(ch.step, tensors)
        replayer.check_state_against_record(ch.step)
        for _ in range(ch.length):
            replayer.advance(result)

    return run


def default_response_dir(bundle_dir: str | os.PathLike) -> Path:
    """Where ``witness respond`` writes by default."""
    return Path(str(bundle_dir).rstrip("/") + ".response")
