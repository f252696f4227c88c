"""The audit: every cheap check in full, then random replay challenges; a verdict or an error."""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from tqdm import tqdm

from ..bundle.reader import Bundle, as_bundle
from ..bundle.state import state_tensors
from ..commit.hashing import same
from ..commit.signing import SignedTreeHead, key_fingerprint, public_key_from_hex
from ..data.locate import by_content
from ..data.order import derive_run_seed
from ..errors import MalformedInput, RunRejected, VerificationError
from ..session import (
    TrainingSession,
    describe_device,
    deterministic_device,
    device_info,
    same_hardware,
    torch_version,
)
from ..task.base import Task
from .bounded import SPIKE, blind_text, check_moves
from .challenges import ReplayChallenge, challenges_needed, draw_challenges
from .cheap import check_checkpoints, check_records, probes_from_bundle, task_of, use_threads
from .finddata import committed_dataset
from .ledger import LedgerEntry, drawn_bound, online_bound_from, replayed, verified_challenges
from .online import OnlinePlan, OnlineSamples, OnlineStates, WitnessTrust, check_online
from .replay import (
    DEFAULT_THRESHOLDS,
    CheckpointStates,
    LocalSamples,
    Replayer,
    SegmentPlan,
    check_thresholds,
)
from .reseed import reseeded_same
from .response import MissingState, Response, ResponseSamples
from .usage import check_data_usage, committed_leaves
from .verdict import ChallengeResult, Verdict

__all__ = ["verify_bundle", "task_of", "use_threads", "default_response_dir"]

DEFAULT_CONFIDENCE = 0.99
DEFAULT_BAD_FRACTION = 0.05


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
    witnesses: WitnessTrust | None = None,
    progress: bool = False,
    skip: Collection[int] = (),
    earlier: Sequence[LedgerEntry] = (),
    data_root: bytes | None = None,
    pending_openings: bool = False,
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
    ``beacon_key`` (hex; the verifier's choice, never the bundle's) selected while the run trained
    (or, with ``witnesses``, the windows K of the named witnesses cosigned before their drand rounds),
    from the states the trainer kept for them; ``challenges`` and ``nonce`` play no part. ``skip``
    names selected steps not to replay now (their states have not arrived): the bound counts them as
    steps the audit could not see. ``earlier`` is the ledger of an earlier audit of the same
    commitments (a leaderboard's live rounds, as the states arrived while the run trained): each
    entry must run between this bundle's committed states, and its step is not replayed again.

    The bound comes from the verdict's ledger alone (``verify.ledger``): a step counts only once
    it was replayed from a checked committed state onto a compared one. ``data_root`` is the root
    the verifier expects the run to have trained on (``--data-root``): another one is a rejection.

    A chunked online run opens its parameters' chunks for every step of every window: each opened
    coordinate's move is checked against the optimizer's bound (``verify.bounded``). A window without
    its openings is a rejection, unless ``pending_openings`` (a leaderboard's live audit, while the
    openings still come): then its steps are reported as waiting, and claimed as nothing.
    """
    started = time.perf_counter()
    if mode not in ("offline", "interactive", "online"):
        raise MalformedInput(f"unknown mode {mode!r}")
    if beacon_key is not None and witnesses is not None:
        raise MalformedInput("online mode trusts one beacon (--beacon-key) or witnesses and drand (--witness, "
                             "--drand), not both")
    trust = beacon_key if beacon_key is not None else witnesses
    if (mode == "online") != (trust is not None):
        raise MalformedInput("online mode needs the key of the beacon the verifier trusts (--beacon-key) or the "
                             "witnesses it trusts and a drand chain (--witness NAME=KEY --drand quicknet), and only "
                             "online mode takes them")
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
    if data_root is not None and not same(data_root, m.data_root):
        raise VerificationError(f"the run trained on the data whose root is {m.data_root.hex()}, not on the data "
                                f"root {data_root.hex()} the verifier named", check="data root")

    # the small files the task read (data_files) stand for the files with their content, for every
    # build of the task's parts in this audit (its model too), found when it first asks for one
    with use_threads(m.threads, threads, notes) as used_threads, by_content(m.raw.get("data_files") or {}):
        return _audit(bundle, task, mode, response, exact, thresholds, length, challenges, f, nonce, notes,
                      checks, used_threads, started, progress, confidence, device, leaves, trust, set(skip),
                      list(earlier), data_root is not None, pending_openings)


def _data_checked(task: Task, bundle: Bundle, named: bool, found: str | None, offline: bool) -> str | None:
    """What the run's data root was checked against, or None where only the trainer vouches for it:
    the root the verifier named, the data here (offline), or the data a registered synthetic task
    generates, rebuilt here (any mode; another root is a rejection: the run trained on other data)."""
    m = bundle.manifest
    if named:
        return "the data root the verifier named (--data-root)"
    if offline:
        return f"the dataset here ({found or 'the one the recipe names'})"
    if task.rebuilds_data:
        if not same(task.dataset().commitment_root(m.data_commitment), m.data_root):
            raise VerificationError(f"the run's data root is not that of the data the registered task {m.task!r} "
                                    "generates from its recipe: it trained on other data", check="data root")
        return f"the data the registered task {m.task!r} generates from its recipe (rebuilt here)"
    return None


def _audit(bundle: Bundle, task: Task, mode: str, response: str | os.PathLike | Response | None, exact: bool,
           thresholds: dict[str, float] | None, length: int, challenges: int, f: float, nonce: bytes,
           notes: list[str], checks: list[str], threads: int, started: float, progress: bool,
           confidence: float | None, device: str, leaves_path: str | os.PathLike | None,
           trust: str | WitnessTrust | None, skip: set[int], earlier: list[LedgerEntry], named_root: bool,
           pending_openings: bool) -> Verdict:
    m = bundle.manifest
    local: LocalSamples | None = None
    online = check_online(bundle, trust) if mode == "online" and trust is not None else None
    found = None
    if mode == "offline":
        dataset, found = committed_dataset(task, m)
        if found is not None:
            notes.append(found)
        local = LocalSamples(dataset)
    data_checked = _data_checked(task, bundle, named_root, found, local is not None)
    session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.parallelism, device)
    if online is not None and online.attempts is not None:
        # restarts are priced by run seed: that prices them only where another seed is another computation
        why = reseeded_same(task, m, len(bundle.steps), state_tensors(session.model, session.optimizer))
        if why is not None:
            online.attempts, online.uncounted = None, why
    checks += check_records(bundle, task, session)
    moves, move_failure, failed_window = None, None, None
    if online is not None and m.chunked:
        # before any checkpoint is loaded: the session holds the state the seed gives
        init = {k: v.clone() for k, v in state_tensors(session.model, session.optimizer).items()}
        try:  # cheap, and before replay; a move out of bounds rejects the run with the rest of its verdict
            began = time.perf_counter()
            moves = check_moves(bundle, online, session.model, session.optimizer, init, pending_openings)
            moves.seconds = time.perf_counter() - began
        except MalformedInput:
            raise
        except VerificationError as e:
            move_failure, failed_window = str(e), getattr(e, "window", None)
    leaves = committed_leaves(bundle, task, local.dataset if local else None, leaves_path)
    checks += check_data_usage(bundle, task, leaves, local.dataset if local else None)
    if probes_from_bundle(task, bundle):
        checks.append(f"the {len(task.probe_bytes())} probes the bundle carries are the first samples of the committed "
                      "dataset")
    if leaves is None and local is None and bundle.complete:
        notes.append("the run was recorded before its dataset's leaves were committed (witness 0.4 and "
                     "earlier): its used-data trees are checked only at the replayed samples")
    limits = dict(DEFAULT_THRESHOLDS, **(thresholds or {}))
    checks += check_checkpoints(bundle, session, exact, limits)

    n = len(bundle.steps)
    before = {e.step for e in earlier}
    if online is None:
        if earlier:
            raise MalformedInput("an earlier audit's evidence counts only in the online audit it was part of")
        drawn = draw_challenges(bundle.final_head, nonce, n, challenges, length)
    else:
        drawn = [ReplayChallenge(t, 1) for t in sorted({*online.selected, *online.late_selected})
                 if t not in skip and t not in before]
        checks.append(online.describe())
        if before & set(online.selected):
            checks.append(f"{len(before & set(online.selected))} selected step(s) replayed by an earlier audit of the "
                          "same commitments, as their states arrived")
        if skip & set(online.selected) - before:
            notes.append(f"{len(skip & set(online.selected) - before)} selected step(s) not replayed now (their "
                         "states have not arrived): the bound counts them as bad steps the audit cannot see")
        if online.unaudited:
            notes.append(f"steps {online.unaudited.start}..{online.unaudited.stop - 1} have no "
                         f"{'witnessed window' if online.witnessed else 'beacon statement'}: not audited online (the "
                         "bound counts them as bad steps the audit cannot see)")
        for r in online.late:
            notes.append(f"steps {r.start}..{r.stop - 1}: their window was cosigned within a drand period of its "
                         "round, so its draw might have been known: not audited online (the bound counts them as bad "
                         "steps the audit cannot see; the steps its draw selects are replayed all the same)")
    verdict = Verdict(
        accepted=False, mode=mode, exact=exact, task=m.task, steps=n, complete=bundle.complete,
        signer=key_fingerprint(m.public_key), challenges=len(drawn) if online is None else len(online.selected),
        bad_fraction=f,
        detection_probability=0.0, nonce=nonce.hex() if online is None else "",
        notes=notes, checks=checks, thresholds={} if exact else limits,
        state_every=m.state_every, threads=threads, confidence=confidence,
        data_root=m.data_root.hex(), data_checked=data_checked,
    )
    if move_failure is not None:
        verdict.failures.append(move_failure)
    if moves is not None:
        verdict.moves = moves.to_json() | {"summary": moves.describe()}
        verdict.checks.append(moves.describe())
        if moves.blind:
            verdict.notes.append(f"the schedule lets step(s) {blind_text(moves.blind)} move a coordinate by the whole "
                                 f"RMS of {', '.join(moves.blind_tensors[:3])}"
                                 f"{' and others' if len(moves.blind_tensors) > 3 else ''} or more: a tensor swapped "
                                 "in there passes the bounded-move check, and only replay (at rate p) checks those "
                                 "steps")
        if moves.spikes:
            verdict.notes.append(f"the schedule spikes at step(s) {blind_text(moves.spikes)}: each may move a coordinate "
                                 f"over {SPIKE:g} times as far as the run's median step, so a model that near the honest "
                                 "one passes the bounded-move check there, and only replay (at rate p) checks those "
                                 "steps")
    elif move_failure is not None:  # which window's openings failed, for a leaderboard to name that file
        verdict.moves = {"failed_window": failed_window, "summary": "every step: the bounded-move check failed"
                         + (f" in the window closing at size {failed_window}" if failed_window else "") + " (below)"}
    elif online is not None and m.online is not None:
        verdict.notes.append("every step: bounded move not checked (the run commits no parameter chunks)")
    if online is not None:
        verdict.online = {"beacon": online.beacon, "p": online.p, "every": online.every, "windows": online.windows,
                          "selected": online.selected, "covered": online.covered,
                          "unaudited": online.unseen, "final": online.final, "witnessed": online.witnessed, "others": online.others,
                          "attempts": online.attempts, "branches": online.branches, "priced": online.priced,
                          "trust_warning": online.trust_warning, "uncounted": online.uncounted,
                          "linking": online.linking()}
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
    for entry in earlier:
        replayer.add_earlier(entry)

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

    if verdict.moves is not None:  # what holding each loaded or reached state to its param_root cost
        verdict.moves["root_check_seconds"] = replayer.root_seconds
    verdict.replayed_steps = replayer.steps_run
    verdict.distinct_steps = len(replayer.distinct)
    verdict.replay_flops = replayer.steps_run * task.flops_per_step()
    verdict.training_flops = n * task.flops_per_step()
    verdict.ledger = list(replayer.ledger)
    _bound(verdict, drawn, online, f, n)
    verdict.verify_seconds = time.perf_counter() - started
    verdict.accepted = not verdict.failures
    if verdict.failures:
        raise RunRejected(verdict.failures, verdict)
    return verdict


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
