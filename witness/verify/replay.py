"""Replay: re-run committed steps from a committed state and compare with their records.

A challenge on step ``t`` replays a *segment*: from the committed state at or before ``t`` to
the committed state at or after ``t + length``. Every state replay starts from must hash to its
commitment, every replayed step must reproduce its record, and the segment must end on its
committed state: bit for bit (its hash) in exact mode, within reported thresholds over the
*whole* state in tolerance mode. So nothing the verifier loads is left unbound.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..bundle.checkpoint import read_checkpoint
from ..bundle.reader import Bundle
from ..bundle.schema import StepRecord
from ..bundle.state import check_aliases, state_distances, state_hash
from ..commit.hashing import same
from ..data.dataset import Dataset
from ..errors import MalformedInput, VerificationError
from ..fingerprint.chunks import ChunkLayout
from ..fingerprint.probes import relative_distance
from ..methods.remote import open_session
from ..session import TrainingSession, warn_mkl
from ..task.base import Task
from .challenges import ReplayChallenge
from .ledger import LedgerEntry
from .verdict import ChallengeResult

# Tolerance mode, for replay on other hardware (other kernels): relative distances. The first
# four are compared at every replayed step, the last three between the replayed and the
# committed state at the end of every segment, over all coordinates.
DEFAULT_THRESHOLDS = {"loss": 1e-4, "fingerprint": 1e-3, "sketch": 1e-5, "update": 1e-2,
                      "parameters": 1e-5, "buffers": 1e-4, "optimizer": 1e-3}


def check_thresholds(thresholds: dict[str, float]) -> dict[str, float]:
    """``thresholds`` if every name is known and every value a finite number in [0, 1): all are
    relative distances, and one of 1 or more would accept a state that shares nothing."""
    unknown = sorted(set(thresholds) - set(DEFAULT_THRESHOLDS))
    if unknown:
        raise MalformedInput(f"unknown threshold {unknown[0]!r}; the thresholds are {', '.join(DEFAULT_THRESHOLDS)}")
    for name, v in thresholds.items():
        if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v < 1:
            raise MalformedInput(f"the {name} threshold must be a number from 0 up to 1 (a relative distance), "
                                 f"not {str(v)[:40]}")
    return thresholds


class SampleSource(Protocol):
    """Where replay gets the raw samples of a batch; every sample is checked against the commitments."""

    def samples(self, step: int, indices: Sequence[int], batch_root: bytes) -> list[bytes]:
        """Canonical bytes of the batch of ``step``."""
        ...


class StateSource(Protocol):
    """Where replay gets a committed state (the replayer checks it against its hash)."""

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The state after ``step`` updates."""
        ...


class LocalSamples:
    """Samples from the verifier's own copy of the dataset (its root was checked against the manifest)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def samples(self, step: int, indices: Sequence[int], batch_root: bytes) -> list[bytes]:
        """Read the batch and check its root."""
        if not same(self.dataset.batch_root(indices), batch_root):
            raise VerificationError("the batch's samples do not hash to the committed batch root", step=step, check="data")
        return [self.dataset.sample_bytes(i) for i in indices]


class CheckpointStates:
    """States from the bundle's own checkpoint files (offline mode)."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The checkpoint after ``step`` updates."""
        return read_checkpoint(self.bundle.checkpoints[step])


@dataclass(frozen=True)
class SegmentPlan:
    """Where replay may start (``starts``) and where it must end (``ends``): committed steps, ascending.

    Offline replay starts at checkpoints (it needs the tensors), interactive replay at any
    committed state (the trainer supplies it). Exact replay ends at any committed state (its hash
    is compared); tolerance mode needs the committed tensors at the end as well.
    """

    starts: Sequence[int]
    ends: Sequence[int]

    def start(self, step: int) -> int:
        """The last committed start at or before ``step`` (none: unusable here, never a wrap-around
        to a later state, from which replay would reach the step without replaying it)."""
        i = bisect.bisect_right(self.starts, step) - 1
        if i < 0:
            raise MalformedInput(f"step {step}: replay: the bundle holds no committed state at or before step {step} "
                                 "to replay it from (an online run may leave out its checkpoints: audit it online, "
                                 "with --mode online, or with the trainer's response, --mode interactive)")
        return self.starts[i]

    def end(self, step: int) -> int:
        """The first committed end at or after ``step``."""
        i = bisect.bisect_left(self.ends, step)
        if i == len(self.ends):  # a log signed past its last checkpoint, replayed in tolerance mode
            raise VerificationError("no committed state after this step to end its replay on", step=step,
                                    check="replay")
        return self.ends[i]

    def segment(self, step: int, length: int) -> tuple[int, int]:
        """The states a challenge of ``length`` steps at ``step`` replays from and to."""
        return self.start(step), self.end(step + length)


def segment_action(position: int | None, replayed_from: int | None, step: int, length: int, start: int,
                   exact: bool) -> str:
    """What replay does for a challenge at ``step`` whose segment starts at ``start``, standing at
    ``position`` after replaying every step from ``replayed_from``: ``"done"`` (an earlier challenge
    replayed and checked it already), ``"go on"`` (exact replay goes on from where it is: every
    state it passed was checked bit for bit) or ``"load"`` (from the committed state at ``start``)."""
    if replayed_from is not None and position is not None and replayed_from <= step and step + length <= position:
        return "done"
    if exact and position is not None and start <= position <= step:
        return "go on"
    return "load"


def states_read(plan: SegmentPlan, drawn: Sequence[ReplayChallenge], exact: bool) -> list[int]:
    """The committed states an audit of ``drawn`` (in order) reads from its state source, where every
    step replays as recorded: each segment start it loads, and in tolerance mode each segment end it
    compares. What ``witness respond`` ships, and no more."""
    reads: list[int] = []
    position = replayed_from = None
    for ch in drawn:
        start, end = plan.segment(ch.step, ch.length)
        action = segment_action(position, replayed_from, ch.step, ch.length, start, exact)
        if action == "done":
            continue
        if action == "load":
            reads.append(start)
            replayed_from = start
        position = end
        if not exact:
            reads.append(end)
    return reads


def same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    """Equal, value for value, where a NaN equals a NaN: a diverged run's records hold NaN (written as
    "nan"), and its replay gives NaN again."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def limit_for(distance: str, thresholds: dict[str, float]) -> float:
    """The threshold a state distance (``parameters``, ``buffers``, ``optimizer.<key>``) must stay within."""
    return thresholds["optimizer" if distance.startswith("optimizer.") else distance]


def check_state(bundle: Bundle, session: TrainingSession, step: int, exact: bool,
                thresholds: dict[str, float]) -> None:
    """The session's state must be the one recorded after ``step`` updates (hash at 0, else fingerprint)."""
    if step == 0:
        got = state_hash(session.state(), bundle.manifest.state_digest)
        if not same(got, bundle.manifest.init_state_hash):
            raise VerificationError("the initial state is not the committed one", step=0, check="state")
        return
    rec = bundle.steps[step - 1]
    fp, sk = session.fingerprint(), session.sketch()
    if exact:
        if fp.digest != rec.digest.hex() or not same_floats(sk, rec.sketch):
            raise VerificationError("the state does not match the recorded fingerprint and sketch",
                                    step=step - 1, check="state")
    elif relative_distance(fp.vector(), rec.fingerprint_vector) > thresholds["fingerprint"] or \
            relative_distance(sk, rec.sketch) > thresholds["sketch"]:
        raise VerificationError("the state is too far from the recorded fingerprint and sketch",
                                step=step - 1, check="state")


class Replayer:
    """A training session that replays committed segments and checks every record and state."""

    def __init__(self, bundle: Bundle, task: Task, source: SampleSource, states: StateSource,
                 plan: SegmentPlan, exact: bool = True, thresholds: dict[str, float] | None = None,
                 device: str | torch.device = "cpu"):
        m = bundle.manifest
        self.bundle, self.task, self.source, self.states, self.plan = bundle, task, source, states, plan
        self.exact = exact
        self.thresholds = dict(DEFAULT_THRESHOLDS, **(thresholds or {}))
        warn_mkl()
        self.session = open_session(task, m.run_seed, m.dataset_size, m.world_size, m.parallelism, device)
        self.parameters = {f"model.{n}" for n in self.session.parameter_names()}
        self.aliases = self.session.aliases()  # tied weights: the task's model says which, not a bundle
        # a chunked run's records commit their parameters' chunk root too: every state loaded or reached
        # must have it (a root a window's openings were checked against that is not its state's own
        # would let the openings show a trajectory the run did not take)
        # (version 4 holds a loaded state to the model's whole tensors: its chunks open into its hash)
        self.layout = ChunkLayout.of_model(self.session.model, m.online["chunk_bytes"], 1 if m.tree else m.state_shards) \
            if m.chunked else None
        self.root_seconds = 0.0
        self.position: int | None = None
        self._replayed_from: int | None = None  # every step from here to `position` was replayed and checked
        self.steps_run = 0
        self.distinct: set[int] = set()  # the steps replayed, each once however often it was replayed
        # the evidence: a step enters the ledger only once replay reached a committed state after it
        # and compared it, starting from a committed state whose hash was checked (``_origin``)
        self.ledger: list[LedgerEntry] = []
        self._done: set[int] = set()
        self._origin: tuple[int, str] | None = None
        self._pending: list[int] = []  # replayed since the last compared committed state

    def committed(self, step: int) -> dict[str, torch.Tensor]:
        """The state after ``step`` updates from the state source, checked against its commitment."""
        tensors = self.states.state(step)
        want = self.bundle.committed_state(step)
        if want is None or not same(state_hash(tensors, self.bundle.manifest.state_digest), want):
            raise VerificationError(f"the state after {step} update(s) does not hash to the committed state",
                                    step=step, check="state")
        check_aliases(self.aliases, tensors, f"the state after {step} update(s)", step=step)
        if step > 0:
            self.check_param_root(step - 1, tensors)
        return tensors

    def check_param_root(self, t: int, tensors: dict[str, torch.Tensor]) -> None:
        """The state after step ``t`` against the chunk root its record commits (a chunked run)."""
        leaves = self.bundle.steps[t].state_leaves
        if leaves is not None and leaves != len(tensors):  # version 4: where its openings put each leaf
            raise VerificationError(f"the record commits a state of {leaves} tensors, and its state holds "
                                    f"{len(tensors)}", step=t, check="state")
        root = self.bundle.steps[t].param_root
        if self.layout is None or (root is None and leaves is None):
            return
        if root is None:  # version 4: the chunks open into the state hash itself, which the state hashes to
            misfit = self.layout.misfit(tensors)
            if misfit:
                raise VerificationError(f"the state after step {t} does not fit the task's model: {misfit}", step=t,
                                        check="state")
            return
        started = time.perf_counter()
        try:
            ok = same(self.layout.root(tensors), root)
        except ValueError as e:  # a committed state whose parameters do not fit the task's model
            raise VerificationError(f"the state after step {t} does not fit the task's model: {e}", step=t,
                                    check="state") from None
        self.root_seconds += time.perf_counter() - started
        if not ok:
            raise VerificationError("the record's param_root is not the chunk root of its committed state's "
                                    "parameters (the chunks its windows opened are not this state's)", step=t,
                                    check="moves")

    def load(self, step: int) -> None:
        """Start from the committed state after ``step`` updates, and check it against its record."""
        self.session.load(self.committed(step), step)
        self.position = self._replayed_from = step
        self._origin, self._pending = (step, self.bundle.committed_state(step).hex()), []  # type: ignore[union-attr]
        check_state(self.bundle, self.session, step, self.exact, self.thresholds)

    def add_earlier(self, entry: LedgerEntry) -> None:
        """Evidence from an earlier audit of the same commitments (a leaderboard's live round), kept
        only where its start and end are this bundle's committed states."""
        n = len(self.bundle.steps)
        start = self.bundle.committed_state(entry.start) if entry.start <= n else None
        end = self.bundle.committed_state(entry.end) if entry.end <= n else None
        if start is None or end is None or start.hex() != entry.start_hash or end.hex() != entry.end_hash:
            raise MalformedInput(f"an earlier replay of step {entry.step} is not from and to this run's committed "
                                 "states")
        self._record(LedgerEntry(**{**entry.__dict__, "earlier": True}))

    def challenge(self, step: int, length: int, result: ChallengeResult) -> None:
        """Replay the segment that holds steps ``step .. step + length - 1``; raise on any mismatch,
        and unless the ledger then holds every one of those steps."""
        start, end = self.plan.segment(step, length)
        action = segment_action(self.position, self._replayed_from, step, length, start, self.exact)
        if action == "load":
            self.load(start)
        try:
            while action != "done" and self.position < end:  # type: ignore[operator]
                self.advance(result)
            if action != "done" and not self.exact:
                self.compare_state(end, result)
        except VerificationError:
            self.position = self._replayed_from = self._origin = None
            self._pending = []
            raise
        missing = [t for t in range(step, step + length) if t not in self._done]
        if missing:
            raise VerificationError(f"the challenge replayed no evidence for step {missing[0]}: no replay from a "
                                    "checked committed state reached a committed state after it", step=step,
                                    check="replay")

    def _record(self, entry: LedgerEntry) -> None:
        if entry.step not in self._done:
            self.ledger.append(entry)
            self._done.add(entry.step)

    def _reached(self, end: int, comparison: str) -> None:
        """Replay reached the committed state after ``end`` updates and it compared: the steps
        replayed since the last such state are evidence."""
        assert self._origin is not None
        want = self.bundle.committed_state(end)
        assert want is not None
        for t in self._pending:
            self._record(LedgerEntry(t, self._origin[0], self._origin[1], end, want.hex(), comparison))
        self._pending = []

    def advance(self, result: ChallengeResult | None = None) -> None:
        """Replay the step at the current position and compare everything with its record."""
        if self.position is None:
            raise RuntimeError("no state loaded")
        t = self.position
        rec = self.bundle.steps[t]
        samples = self.source.samples(t, rec.batch, rec.batch_root)
        before = self.session.sketch() if not self.exact else None
        out = self.session.step(t, samples)
        self.position = t + 1
        self.steps_run += 1
        self.distinct.add(t)
        self._pending.append(t)
        fp, sk = self.session.fingerprint(), self.session.sketch()
        if self.exact:
            self._compare_exact(rec, out.loss, out.grad_norm, fp.digest, fp.vector(), sk)
            if rec.state_hash is not None:
                got = state_hash(self.session.state(), self.bundle.manifest.state_digest)
                if not same(got, rec.state_hash):
                    raise VerificationError("the replayed training state does not hash to the committed one "
                                            "(parameters, buffers or optimizer state differ)", step=t, check="replay")
                self.check_param_root(t, self.session.state())
                self._reached(t + 1, "hash")
        else:
            self._compare_tolerant(rec, out.loss, fp.vector(), sk, before, result)

    def compare_state(self, step: int, result: ChallengeResult | None) -> None:
        """Tolerance mode: the whole replayed state against the committed one, over all coordinates."""
        want = self.committed(step)
        got = self.session.state()
        try:
            d = state_distances(got, want, self.parameters)
        except ValueError as e:
            raise VerificationError(f"the replayed state is not the committed one: {e}", step=step - 1,
                                    check="replay") from None
        self._judge(d, step - 1, result, "at the segment's committed state")
        self._reached(step, "tolerance")

    def _judge(self, d: dict[str, float], step: int, result: ChallengeResult | None, where: str = "") -> None:
        if result is not None:
            for k, v in d.items():
                result.distances[k] = max(result.distances.get(k, 0.0), v)
        for k, v in d.items():
            limit = limit_for(k, self.thresholds)
            if not v <= limit:
                raise VerificationError(f"{k} distance {v:.3g} exceeds the threshold {limit:.3g}"
                                        + (f" {where}" if where else ""), step=step, check="replay")

    def _compare_exact(self, rec: StepRecord, loss: float, gn: float, digest: str, fpv: list[float], sk: list[float]) -> None:
        t = rec.step
        if not (loss == rec.loss or (math.isnan(loss) and math.isnan(rec.loss))):
            raise VerificationError(f"replayed loss {loss!r} differs from the recorded {rec.loss!r}", step=t, check="replay")
        if digest != rec.digest.hex() or not same_floats(fpv, rec.fingerprint_vector):
            raise VerificationError("replayed behavioral fingerprint differs from the record "
                                    f"(distance {relative_distance(fpv, rec.fingerprint_vector):.3g})", step=t, check="replay")
        if not same_floats(sk, rec.sketch):
            raise VerificationError(f"replayed parameter sketch differs from the record (distance {relative_distance(sk, rec.sketch):.3g})",
                                    step=t, check="replay")
        if not (gn == rec.grad_norm or (math.isnan(gn) and math.isnan(rec.grad_norm))):
            raise VerificationError(f"replayed gradient norm {gn!r} differs from the recorded {rec.grad_norm!r}",
                                    step=t, check="replay")

    def _compare_tolerant(self, rec: StepRecord, loss: float, fpv: list[float], sk: list[float],
                          before: list[float] | None, result: ChallengeResult | None) -> None:
        t = rec.step
        prev = self.bundle.steps[t - 1].sketch if t > 0 else None
        d = {
            "loss": abs(loss - rec.loss) / max(abs(rec.loss), 1e-12),
            "fingerprint": relative_distance(fpv, rec.fingerprint_vector),
            "sketch": relative_distance(sk, rec.sketch),
        }
        if before is not None and prev is not None:
            d["update"] = relative_distance([a - b for a, b in zip(sk, before, strict=True)],
                                            [a - b for a, b in zip(rec.sketch, prev, strict=True)])
        self._judge(d, t, result)
