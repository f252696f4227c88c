"""The audit: every cheap check in full, then random replay challenges; a verdict or an error.

``Verifier(trust, policy).verify(bundle, evidence)`` is the front door (``verify.policy`` holds the
three inputs). The steps of one audit live in ``_Audit``, one method a stage, in the order they run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from ..bundle.reader import Bundle, as_bundle
from ..commit.hashing import same
from ..commit.signing import key_fingerprint, public_key_from_hex
from ..data.dataset import Dataset
from ..data.locate import by_content
from ..data.order import derive_run_seed
from ..errors import MalformedInput, RunRejected, VerificationError
from ..methods.remote import MethodFailed, MethodSandbox, open_session
from ..session import (
    TrainingSession,
    describe_device,
    deterministic_device,
    device_info,
    same_hardware,
    torch_version,
)
from ..task.base import Task
from .bounded import check_moves
from .challenges import ReplayChallenge, draw_challenges
from .cheap import check_checkpoints, check_records, probes_from_bundle, task_of, use_threads
from .explain import move_notes, online_notes, online_summary
from .finddata import committed_dataset
from .kept import OnlineSamples, OnlineStates
from .ledger import LedgerEntry, drawn_bound, online_bound_from, replayed, verified_challenges
from .online import OnlinePlan, check_online
from .policy import DEFAULT_BAD_FRACTION, DEFAULT_CONFIDENCE, Evidence, Policy, Trust
from .replay import DEFAULT_THRESHOLDS, CheckpointStates, LocalSamples, Replayer, SegmentPlan
from .reseed import reseeded_same
from .response import MissingState, Response, ResponseSamples
from .usage import check_data_usage, committed_leaves
from .verdict import ChallengeResult, Verdict

if TYPE_CHECKING:
    from ..data.leaves import DatasetLeaves

__all__ = ["DEFAULT_BAD_FRACTION", "DEFAULT_CONFIDENCE", "Verifier", "default_response_dir"]


class Verifier:
    """Audits bundles under one ``Trust`` and one ``Policy``, neither ever read from a bundle.

    ``verify`` returns an accepted verdict or raises a ``VerificationError``: ``RunRejected`` (with
    the verdict) where a check failed, ``MalformedInput`` where the input cannot be audited here.
    """

    def __init__(self, trust: Trust | None = None, policy: Policy | None = None, *, progress: bool = False) -> None:
        self.trust = Trust() if trust is None else trust
        self.policy = Policy() if policy is None else policy
        self.progress = progress
        if (self.policy.mode == "online") != (self.trust.online is not None):
            raise MalformedInput("online mode needs the key of the beacon the verifier trusts (--beacon-key) or the "
                                 "witnesses it trusts and a drand chain (--witness NAME=KEY --drand quicknet), and "
                                 "only online mode takes them")

    def verify(self, bundle: str | os.PathLike | Bundle, evidence: Evidence | None = None) -> Verdict:
        """Audit one bundle (a folder, or one opened already) with the evidence it does not carry."""
        return verify_round(self, bundle, evidence, LiveRound())


@dataclass(frozen=True)
class LiveRound:
    """A leaderboard's live round of an online audit, as the states arrive while the run trains.

    Internal to the leaderboard, never a verifier's option. ``skip``: selected steps whose states
    have not arrived (the bound counts them as steps the audit could not see). ``earlier``: the
    ledger of earlier rounds of the same commitments (each entry must run between this bundle's
    committed states; its step is not replayed again). ``pending_openings``: windows whose parameter
    openings have not arrived are reported as waiting and claimed as nothing, not rejected.
    """

    skip: Collection[int] = frozenset()
    earlier: Sequence[LedgerEntry] = ()
    pending_openings: bool = False


def verify_round(verifier: Verifier, source: str | os.PathLike | Bundle, evidence: Evidence | None,
                 live: LiveRound) -> Verdict:
    """``Verifier.verify`` with a leaderboard's live-round state (``LiveRound``)."""
    started = time.perf_counter()
    trust, policy, evidence = verifier.trust, verifier.policy, evidence or Evidence()
    nonce = os.urandom(16) if policy.nonce is None else policy.nonce
    challenges = policy.drawn()
    bundle = as_bundle(source, trust.signer)
    response = evidence.response
    if policy.mode == "interactive":  # read (strictly) before any work: an unreadable response is unusable input
        if response is None:
            raise MalformedInput("interactive mode needs the trainer's response (witness respond)")
        response = response if isinstance(response, Response) else Response(response)
    m = bundle.manifest
    notes = list(bundle.notes)
    # the small files the task read (data_files) stand for the files with their content, for every
    # build of the task's parts in this audit (its model too), found when it first asks for one
    with use_threads(m.threads, policy.threads, notes) as threads, by_content(m.raw.get("data_files") or {}), \
            _method_box(bundle, trust, policy, threads) as box:
        task = task_of(bundle, box)
        checks = _trusted(bundle, task, trust, policy, notes)
        if box is not None:
            w = box.wheel
            checks.append(f"the method {w.distribution} {w.version} (wheel sha256 {w.sha256[:16]}…) is the code the "
                          "run pins, and ran only in the sandbox (no network, read-only system, its own scratch, "
                          "limits on time, memory and processes); every state it reached was hashed here")
        audit = _Audit(verifier, bundle, task, replace(evidence, response=response), live, notes, checks, threads)
        return audit.run(challenges, nonce, started)


@contextmanager
def _method_box(bundle: Bundle, trust: Trust, policy: Policy, threads: int) -> Iterator[MethodSandbox | None]:
    """The sandbox a submitted method's steps run in (``Trust.method``), or None for a registered task."""
    if trust.method is None:
        yield None
        return
    m = bundle.manifest
    if policy.mode == "offline" and trust.dataset is None:
        raise MalformedInput("a submitted method's run is verified from the samples its response or bundle carries, "
                             "checked against the dataset's leaves (use --mode interactive or --mode online), or "
                             "offline from a dataset the verifier holds (Trust.dataset)")
    if m.chunked or m.world_size > 1:
        raise MalformedInput("a submitted method is replayed in the sandbox for runs of one process without "
                             "chunked openings; this run has " + ("chunked openings" if m.chunked else
                                                                   f"{m.world_size} ranks"))
    with MethodSandbox(trust.method, m.task, threads) as box:
        yield box


def _trusted(bundle: Bundle, task: Task, trust: Trust, policy: Policy, notes: list[str]) -> list[str]:
    """The checks of what the verifier named (heads, ticket, data root) and of this machine against
    the manifest; what they leave unchecked goes into ``notes``."""
    m = bundle.manifest
    if m.torch_version != torch_version():
        if policy.exact:
            raise MalformedInput(f"the run was recorded with torch {m.torch_version}; this machine has torch "
                                 f"{torch_version()}: exact replay needs the same kernels (install torch=="
                                 f"{m.torch_version}, or verify with --tolerance)")
        notes.append(f"recorded with torch {m.torch_version}, replayed with {torch_version()}")
    for h in trust.published_heads:
        h.verify(public_key_from_hex(m.public_key))
        if not bundle.log.extends(h.size, h.root):
            raise VerificationError(f"the log does not extend the published tree head of size {h.size}: "
                                    "it was rewritten after that head was published", check="log")
    checks = [f"the log extends {len(trust.published_heads)} published tree head(s)"] \
        if trust.published_heads else []
    here = device_info(deterministic_device(policy.device), task.compiles)
    if not same_hardware(m.device, here):
        if policy.exact:
            raise MalformedInput(f"the run was recorded on {describe_device(m.device)}; this replay would run on "
                                 f"{describe_device(here)}: bit-exact replay needs the same hardware (replay there, "
                                 f"with --device {m.device['kind']}, or verify with --tolerance)")
        notes.append(f"recorded on {describe_device(m.device)}, replayed on {describe_device(here)} in tolerance mode")
    elif policy.exact:
        checks.append(f"replayed on the run's own hardware, {describe_device(here)}: bit for bit")
        if m.device["kind"] == "cpu" and "kernels" not in m.device:
            notes.append("the run did not record its CPU's kernel choice (witness before 0.4.0): exact replay "
                         "assumes this CPU picks the same kernels; a CPU that picks others can fail honest steps, "
                         "which --tolerance tells apart")
    if not same(derive_run_seed(m.data_root, m.r), m.run_seed):
        raise VerificationError("the run seed is not H(data root || r)", check="seed")
    if trust.ticket is not None:
        if m.r_source != "ticket" or not same(m.r, trust.ticket):
            raise VerificationError("the run seed is not derived from the ticket issued for it", check="seed")
        checks.append("r is the issued ticket")
    elif m.r_source == "ticket":
        notes.append("the manifest says r came from a ticket; only its issuer can check that (--ticket)")
    checks += ["signatures and log consistency of every signed tree head", "run seed = H(data root || r)"]
    if trust.data_root is not None and not same(trust.data_root, m.data_root):
        raise VerificationError(f"the run trained on the data whose root is {m.data_root.hex()}, not on the data "
                                f"root {trust.data_root.hex()} the verifier named", check="data root")
    return checks


class _Audit:
    """One audit, after the checks of what the verifier named: its stages, in the order they run."""

    def __init__(self, verifier: Verifier, bundle: Bundle, task: Task, evidence: Evidence, live: LiveRound,
                 notes: list[str], checks: list[str], threads: int) -> None:
        self.policy, self.trust, self.progress = verifier.policy, verifier.trust, verifier.progress
        self.bundle, self.task, self.m = bundle, task, bundle.manifest
        self.response, self.leaves_path = evidence.response, evidence.leaves
        self.skip, self.earlier, self.pending = set(live.skip), list(live.earlier), live.pending_openings
        self.notes, self.checks, self.threads = notes, checks, threads
        self.limits = dict(DEFAULT_THRESHOLDS, **self.policy.thresholds)
        self.local: LocalSamples | None = None
        self.online: OnlinePlan | None = None

    def run(self, challenges: int, nonce: bytes, started: float) -> Verdict:
        """Every cheap check, then replay; the verdict, or ``RunRejected`` with it."""
        policy, m = self.policy, self.m
        if policy.mode == "online":
            self.online = check_online(self.bundle, self.trust.online)
        found = None
        if policy.mode == "offline":
            dataset, found = self._offline_dataset()
            if found is not None:
                self.notes.append(found)
            self.local = LocalSamples(dataset)
        data_checked = self._data_checked(found)
        session = open_session(self.task, m.run_seed, m.dataset_size, m.world_size, m.parallelism, policy.device)
        self._price_restarts(session)
        self.checks += check_records(self.bundle, self.task, session)
        moves, move_failure, failed_window = self._moves(session)
        leaves = self._data_checks()
        self.checks += check_checkpoints(self.bundle, session, policy.exact, self.limits)
        drawn = self._drawn(challenges, nonce)
        online, n = self.online, len(self.bundle.steps)
        verdict = Verdict(
            accepted=False, mode=policy.mode, exact=policy.exact, task=m.task, steps=n, complete=self.bundle.complete,
            signer=key_fingerprint(m.public_key), challenges=len(drawn) if online is None else len(online.selected),
            bad_fraction=policy.fraction, detection_probability=0.0, nonce=nonce.hex() if online is None else "",
            notes=self.notes, checks=self.checks, thresholds={} if policy.exact else self.limits,
            state_every=m.state_every, threads=self.threads, confidence=policy.confidence,
            data_root=m.data_root.hex(), data_checked=data_checked,
        )
        move_notes(verdict, moves, move_failure, failed_window, online is not None and m.online is not None)
        if online is not None:
            verdict.online = online_summary(online)
        if self.local is None and self.bundle.complete and policy.mode != "offline":
            verdict.checks.append("every replayed sample is the committed dataset's, with its documents")
        if not self.bundle.complete:
            verdict.notes.append(f"incomplete run: {n} of {m.steps_planned} planned steps are signed; verified as a "
                                 f"{n}-step run")
        replayer = self._replayer(leaves)
        self._replay(verdict, replayer, drawn)
        if verdict.moves is not None:  # what holding each loaded or reached state to its param_root cost
            verdict.moves["root_check_seconds"] = replayer.root_seconds
        verdict.replayed_steps = replayer.steps_run
        verdict.distinct_steps = len(replayer.distinct)
        verdict.replay_flops = replayer.steps_run * self.task.flops_per_step()
        verdict.training_flops = n * self.task.flops_per_step()
        verdict.ledger = list(replayer.ledger)
        _bound(verdict, drawn, online, policy.fraction, n)
        verdict.verify_seconds = time.perf_counter() - started
        verdict.accepted = not verdict.failures
        if verdict.failures:
            raise RunRejected(verdict.failures, verdict)
        return verdict

    def _offline_dataset(self) -> tuple[Dataset, str | None]:
        """The data an offline audit replays from: the verifier's own (``Trust.dataset``), which must be the
        committed one, or the one the task names, found here."""
        given, m = self.trust.dataset, self.m
        if given is None:
            return committed_dataset(self.task, m)
        if len(given) != m.dataset_size or not same(given.commitment_root(m.data_commitment), m.data_root):
            raise VerificationError(f"the run trained on the data whose root is {m.data_root.hex()}, not on the "
                                    "dataset the verifier holds", check="data root")
        return given, "replayed from the dataset the verifier holds (its root is the run's)"

    def _data_checked(self, found: str | None) -> str | None:
        """What the run's data root was checked against, or None where only the trainer vouches for it:
        the root the verifier named, the data here (offline), or the data a registered synthetic task
        generates, rebuilt here (any mode; another root is a rejection: the run trained on other data)."""
        m, task = self.m, self.task
        if self.trust.data_root is not None:
            return "the data root the verifier named (--data-root)"
        if self.local is not None:
            return f"the dataset here ({found or 'the one the recipe names'})"
        if task.rebuilds_data:
            if not same(task.dataset().commitment_root(m.data_commitment), m.data_root):
                raise VerificationError(f"the run's data root is not that of the data the registered task {m.task!r} "
                                        "generates from its recipe: it trained on other data", check="data root")
            return f"the data the registered task {m.task!r} generates from its recipe (rebuilt here)"
        return None

    def _price_restarts(self, session: TrainingSession) -> None:
        """Restarts are priced by run seed: that prices them only where another seed is another computation."""
        online = self.online
        if online is not None and online.attempts is not None:
            why = reseeded_same(self.task, self.m, len(self.bundle.steps),
                                session.state())
            if why is not None:
                online.attempts, online.uncounted = None, why

    def _moves(self, session: TrainingSession) -> tuple:
        """The bounded-move check of a chunked online run: (moves, failure, failed window)."""
        if self.online is None or not self.m.chunked:
            return None, None, None
        # before any checkpoint is loaded: the session holds the state the seed gives
        init = {k: v.clone() for k, v in session.state().items()}
        try:  # cheap, and before replay; a move out of bounds rejects the run with the rest of its verdict
            began = time.perf_counter()
            moves = check_moves(self.bundle, self.online, session.model, session.optimizer, init, self.pending)
            moves.seconds = time.perf_counter() - began
            return moves, None, None
        except MalformedInput:
            raise
        except VerificationError as e:
            return None, str(e), getattr(e, "window", None)

    def _data_checks(self) -> DatasetLeaves | None:
        """The dataset's leaves (the bundle's, the verifier's file, or the data here) and the used-data
        checks against them; returns the leaves."""
        bundle, task, local = self.bundle, self.task, self.local
        leaves = committed_leaves(bundle, task, local.dataset if local else None, self.leaves_path)
        self.checks += check_data_usage(bundle, task, leaves, local.dataset if local else None)
        if probes_from_bundle(task, bundle):
            self.checks.append(f"the {len(task.probe_bytes())} probes the bundle carries are the first samples of "
                               "the committed dataset")
        if leaves is None and local is None and bundle.complete:
            self.notes.append("the run was recorded before its dataset's leaves were committed (witness 0.4 and "
                              "earlier): its used-data trees are checked only at the replayed samples")
        return leaves

    def _drawn(self, challenges: int, nonce: bytes) -> list[ReplayChallenge]:
        """The steps to replay: challenges drawn from the head and nonce, or the online selection."""
        online, before = self.online, {e.step for e in self.earlier}
        if online is None:
            if self.earlier:
                raise MalformedInput("an earlier audit's evidence counts only in the online audit it was part of")
            return draw_challenges(self.bundle.final_head, nonce, len(self.bundle.steps), challenges,
                                   self.policy.length)
        self.checks.append(online.describe())
        online_notes(online, self.skip, before, self.checks, self.notes)
        return [ReplayChallenge(t, 1) for t in sorted({*online.selected, *online.late_selected})
                if t not in self.skip and t not in before]

    def _replayer(self, leaves: DatasetLeaves | None) -> Replayer:
        """The replayer of this mode: where its states and samples come from."""
        bundle, task, m, exact, limits, device = self.bundle, self.task, self.m, self.policy.exact, self.limits, \
            self.policy.device
        committed, checkpoints = bundle.state_steps(), bundle.checkpoint_steps()
        if self.policy.mode == "offline":
            # Offline replay starts from checkpoints; exact replay may end on any committed hash, while
            # tolerance mode needs the committed tensors at the end, so it replays to a checkpoint.
            plan = SegmentPlan(checkpoints, committed if exact else checkpoints)
            states: CheckpointStates | OnlineStates = CheckpointStates(bundle)
            if bundle.missing_checkpoints:
                # An online run that left out checkpoints: replay starts from any state it holds (the
                # selected steps' states are committed by hash, as every state of an online run is).
                held = bundle.held_states()
                plan, states = SegmentPlan(held, committed if exact else held), OnlineStates(bundle)
            replayer = Replayer(bundle, task, self.local, states, plan, exact, limits, device)  # type: ignore[arg-type]
        elif self.policy.mode == "online":
            if leaves is None:
                raise MalformedInput("the online audit needs the dataset's leaves (the bundle's dataset.leaves or "
                                     "--leaves), which the samples kept for the selected steps are checked against")
            source = OnlineSamples(bundle, leaves, task.document_rule)
            # every state is committed (the manifest says so for an online run): a selected step replays alone
            replayer = Replayer(bundle, task, source, OnlineStates(bundle), SegmentPlan(committed, committed), exact,
                                limits, device)
        else:
            resp = self.response
            assert isinstance(resp, Response)
            if resp.head_root != bundle.final_head.root or resp.head_size != bundle.final_head.size:
                raise MalformedInput("the response was made for another tree head")
            samples = ResponseSamples(resp, m.data_root, m.dataset_size, bundle.end, leaves, task.document_rule)
            replayer = Replayer(bundle, task, samples, resp, SegmentPlan(committed, committed), exact, limits, device)
        for entry in self.earlier:
            replayer.add_earlier(entry)
        return replayer

    def _replay(self, verdict: Verdict, replayer: Replayer, drawn: list[ReplayChallenge]) -> None:
        """Replay each drawn challenge; a failure goes into the verdict, not out as an error."""
        for ch in tqdm(drawn, desc="replay challenges", unit="challenge", disable=not self.progress):
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
                    result.failure = "not replayed: an earlier segment failed, and the response holds no state to " \
                                     "start this one from"
                    verdict.results.append(result)
                    continue
                if self.threads != self.m.threads and self.policy.exact:
                    result.failure += f" (replayed at {self.threads} thread(s); the run recorded {self.m.threads})"
                if result.failure not in verdict.failures:  # replays of one segment meet the same bad step
                    verdict.failures.append(result.failure)
                if isinstance(e, MethodFailed):  # the run is rejected: a method that hangs costs one timeout, not q
                    result.replayed_steps = replayer.steps_run - before
                    verdict.results.append(result)
                    break
            result.replayed_steps = replayer.steps_run - before
            verdict.results.append(result)


def _bound(verdict: Verdict, drawn: list[ReplayChallenge], online: OnlinePlan | None, f: float, n: int) -> None:
    """The verdict's bound, from its ledger alone: the challenges (or selected steps) it verifies."""
    if online is None:
        verdict.verified = verified_challenges(verdict.ledger, ((ch.step, ch.length) for ch in drawn))
        verdict.detection_probability = drawn_bound(verdict.ledger, ((ch.step, ch.length) for ch in drawn), f, n)
    else:
        done = replayed(verdict.ledger)
        verdict.verified = sum(1 for t in online.selected if t in done)
        verdict.detection_probability = online_bound_from(verdict.ledger, online.selected, online.p, f, n,
                                                          online.unseen, online.priced)


def default_response_dir(bundle_dir: str | os.PathLike) -> Path:
    """Where ``witness respond`` writes by default."""
    return Path(str(bundle_dir).rstrip("/") + ".response")
