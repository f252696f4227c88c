"""Verification workers: take jobs from the database queue and run the verifier on them.

A worker draws every challenge from the server's own randomness (``lb.randomness``, which is
``os.urandom``) after the final head was received, so a trainer cannot know which steps will be
replayed. It runs the registered task the run's track names; on a contest track, the method the run's
ticket named runs only in the sandbox (``witness.methods``), and its score is computed here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

from sqlalchemy import select, update

from ..bundle.reader import Bundle, open_bundle
from ..commit.dsse import read_json_or_envelope
from ..commit.signing import SignedTreeHead
from ..errors import MalformedInput, RunRejected, VerificationError
from ..evals.evaluate import verify_eval
from ..evals.release import export_model
from ..methods.process import NoSandbox
from ..report import plot_fingerprints, plot_loss, plot_optimizer
from ..store import EVALUATION, evaluation_key, model_key, plot_key
from ..verify.audit import LiveRound, Verifier, verify_round
from ..verify.ledger import LedgerEntry
from ..verify.policy import Policy, Trust
from . import queue
from .certification import record_decision
from .contests import contest_trust, score_contest
from .db import Account, ChallengeRow, Head, Job, OnlineStep, Round, Run, Track, now_ms
from .service import Leaderboard

log = logging.getLogger("witness.leaderboard.worker")


class CannotCheckHere(RuntimeError):
    """A re-challenge this worker cannot run (the server's environment changed, not the run)."""


def worker_name() -> str:
    """host:pid, shown in the challenge history."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _verdict_rows(verdict) -> list[ChallengeRow]:  # noqa: ANN001 - Verdict or None
    return [ChallengeRow(step=r.step, length=r.length, passed=r.passed, distances_json=json.dumps(r.distances),
                         failure=r.failure) for r in (verdict.results if verdict is not None else [])]


def process(lb: Leaderboard, job: Job, worker: str) -> None:
    """Run one claimed job to its end and record the outcome (commits)."""
    if job.kind == "online":
        from .online import process_online

        return process_online(lb, job, worker)
    with lb.Session() as s, ExitStack() as kept:
        job = s.get(Job, job.id)
        run = s.get(Run, job.run_id)
        acct = s.get(Account, run.account_id)
        track = s.get(Track, run.track)
        heads = [SignedTreeHead.from_json(json.loads(h)) for h in
                 s.scalars(select(Head.head_json).where(Head.run_id == run.id).order_by(Head.size))]
        if job.kind == "certify":
            run.status = "verifying"
            s.commit()
        nonce = lb.randomness(16)
        bundle, verdict, failures = None, None, []
        # A run that took online challenges from this server's beacon is certified by the online
        # audit, less the selected steps its workers replayed while it trained; re-challenges are
        # drawn after the fact, as for every run.
        online = job.kind == "certify" and run.online_p is not None
        # the evidence of those replays: each entry runs between the run's committed states, which the
        # audit checks against the submitted bundle before it counts the step in its bound
        earlier = [LedgerEntry.from_json(json.loads(x)) for x in s.scalars(
            select(OnlineStep.ledger_json).where(OnlineStep.run_id == run.id, OnlineStep.status == "passed",
                                                 OnlineStep.ledger_json.is_not(None)))] if online else []
        # the unpacked bundle stays here (not evicted from this machine's cache) until the job is done
        kept.enter_context(lb.store.keep_bundle(run.id))
        try:  # opened (parsed, every hash and signature checked) once, for the audit, evaluation and plots
            bundle = open_bundle(lb.run_bundle(s, run), acct.public_key)
            if online and 0 not in bundle.checkpoints:
                # re-challenges of an online run replay from the states it holds, at the latest from
                # its initial one: a submission without it would leave them nothing to start from
                raise VerificationError("the submission of an online run leaves out its initial checkpoint, "
                                        "which re-challenges replay from", check="checkpoint")
            trust = Trust(signer=acct.public_key, published_heads=heads, ticket=bytes.fromhex(run.r),
                          data_root=bytes.fromhex(track.data_root), **(lb.online_trust(s, run) if online else {}),
                          **contest_trust(lb, s, run, track))
            policy = Policy(mode="online", bad_fraction=lb.settings.bad_fraction) if online else \
                Policy(challenges=job.count, nonce=nonce, bad_fraction=lb.settings.bad_fraction)
            verdict = verify_round(Verifier(trust, policy), bundle, None, LiveRound(earlier=earlier))
        except RunRejected as e:
            verdict, failures = e.verdict, list(e.failures)
        except NoSandbox as e:  # this machine's problem, never the run's: the job fails, the run is not decided
            raise CannotCheckHere(f"this worker cannot run the method of run {run.id}: {e}") from None
        except MalformedInput as e:
            if job.kind != "certify":
                # The certified bundle cannot have changed; this worker can no longer replay it (other
                # hardware, torch or witness release). That is the server's problem, never grounds to
                # revoke: the job fails with the reason and the run keeps its certificate.
                raise CannotCheckHere(f"this worker cannot replay run {run.id}: {e}") from None
            failures = [str(e)]
        except VerificationError as e:
            failures = [str(e)]
        passed = not failures
        rnd = Round(run_id=run.id, job_id=job.id, kind=job.kind, requested_by=job.requested_by, nonce=nonce.hex(),
                    count=verdict.verified if verdict is not None else 0, passed=passed,
                    bound=verdict.detection_probability if verdict is not None else 0.0,
                    detail="; ".join(failures) if failures else (verdict.summary() if verdict else ""),
                    worker=worker, finished_ms=now_ms())
        s.add(rnd)
        s.flush()
        for row in _verdict_rows(verdict):
            row.round_id = rnd.id
            s.add(row)
        if online:  # the selected steps the certification replayed: the run's online count is complete
            for r in (verdict.results if verdict is not None else []):
                s.execute(update(OnlineStep).where(OnlineStep.run_id == run.id, OnlineStep.step == r.step)
                          .values(status="passed" if r.passed else "failed", round_id=rnd.id, failure=r.failure)
                          .execution_options(synchronize_session=False))
        if job.kind == "certify":
            _certify(lb, s, run, track, bundle, verdict, failures)
        elif not passed:
            run.status = "revoked"
            run.reason = (f"certificate revoked: a re-challenge (round {rnd.id}) failed: " + "; ".join(failures))
            run.decided_ms = now_ms()
        elif run.status == "certified":  # a round queued before a revocation adds nothing to it
            run.challenges_passed += rnd.count
            # rounds draw independently, so a bad run escapes all of them: each round's bound comes from
            # its own ledger (1 where it replayed every step), and 1 - (1 - f)^q1 combined with
            # 1 - (1 - f)^q2 this way is 1 - (1 - f)^(q1 + q2)
            run.bound = 1.0 - (1.0 - (run.bound or 0.0)) * (1.0 - rnd.bound)
        s.flush()
        if job.kind == "certify" or run.status in ("certified", "revoked"):
            record_decision(lb, s, run, rnd, verdict, bundle)  # the server signs every decision it makes
        if not queue.finish(s, job.id, worker):
            s.rollback()
            log.warning("job %s was taken from this worker before it finished; its result is dropped", job.id)
            return
        s.commit()


def _certify(lb: Leaderboard, s, run: Run, track: Track, bundle: Bundle | None, verdict,  # noqa: ANN001
             failures: list[str]) -> None:
    """Training verdict, then the evaluation and contamination certificate, then plots."""
    run.verdict_json = json.dumps(verdict.to_json()) if verdict is not None else None
    eval_verdict = None
    if not failures and run.method_id is not None:  # a contest: scored here, blind, never by the trainer
        try:
            aggregates, documents, aliases, within, scored = score_contest(lb, s, run, track, bundle)
            eval_verdict = SimpleNamespace(aggregates=aggregates, detection_probability=1.0, eval_documents=documents,
                                           aliases=aliases, certificate=scored)
            verdict.checks.append(within)
            run.verdict_json = json.dumps(verdict.to_json())
        except NoSandbox as e:
            raise CannotCheckHere(f"this worker cannot run the method of run {run.id}: {e}") from None
        except VerificationError as e:
            failures = [f"evaluation: {e}"]
    elif not failures:
        try:
            local = lb.store.fetch(evaluation_key(run.id), lb.store.scratch(EVALUATION))
            try:
                cert = read_json_or_envelope(local, 256 * 1024 * 1024, "certificate")
            finally:
                local.unlink(missing_ok=True)
            eval_verdict = verify_eval(cert, bundle, spots=lb.settings.eval_spots)
        except RunRejected as e:
            failures = [f"evaluation certificate: {f}" for f in e.failures]
        except VerificationError as e:
            failures = [f"evaluation certificate: {e}"]
    if eval_verdict is not None:
        agg = eval_verdict.aggregates
        run.aggregates_json = json.dumps(agg)
        value = agg.get(track.metric)
        run.metric_value = float(value) if isinstance(value, (int, float)) else None
        run.eval_bound = eval_verdict.detection_probability
        run.contamination = (f"clean: all {eval_verdict.eval_documents} evaluation documents proven absent "
                             "from the training data") + ("; scored by this server on every example, the targets "
                                                          "hidden from the method" if run.method_id else "")
    if bundle is not None and bundle.end is not None and not failures:
        model = lb.store.scratch("model.safetensors")
        try:  # the released file the decision names
            export_model(bundle, model, getattr(eval_verdict, "aliases", None))
            lb.store.put(model_key(run.id), model)
        except VerificationError as e:  # its final state does not hold its tied weights as one tensor
            failures = [f"the final model: {e}"]
    if getattr(eval_verdict, "certificate", None) is not None and not failures:  # the server's scoring, kept
        lb.store.put(evaluation_key(run.id), eval_verdict.certificate)  # with the decision that certifies it
    if bundle is not None:  # a bundle the reader refused has no plots; its rejection says why
        steps = [(r.step, r.passed) for r in (verdict.results if verdict else [])]
        draws = {"loss": lambda p: plot_loss(bundle, p, steps), "optimizer": lambda p: plot_optimizer(bundle, p),
                 "fingerprints": lambda p: plot_fingerprints(bundle, p)}
        for name, draw in draws.items():
            path = lb.store.scratch(f"{name}.svg")
            draw(path)
            lb.store.put(plot_key(run.id, name), path)
    run.decided_ms = now_ms()
    if failures:
        run.status, run.reason = "rejected", "; ".join(failures)
    else:
        run.status, run.reason = "certified", None
        run.challenges_passed = verdict.verified
        run.bound = verdict.detection_probability  # from the verdict's ledger, in every mode


@contextmanager
def _lease(lb: Leaderboard, job_id: int, worker: str, lease_ms: int) -> Iterator[None]:
    """Renew the lease on a job three times per lease period while the block runs."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(lease_ms / 3000):
            with lb.Session() as s:
                queue.renew(s, job_id, worker)

    t = threading.Thread(target=beat, name=f"lease-{job_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def work(lb: Leaderboard, *, worker: str | None = None, once: bool = False, poll_s: float = 0.5,
         stop: Callable[[], bool] | None = None, lease_ms: int = queue.LEASE_MS) -> int:
    """Take and process jobs until ``stop()`` (or the queue is empty, with ``once``); returns jobs done."""
    worker = worker or worker_name()
    done = 0
    while not (stop and stop()):
        with lb.Session() as s:
            queue.requeue_expired(s, lease_ms)
            job = queue.claim(s, worker)
        if job is None:
            if once:
                break
            time.sleep(poll_s)
            continue
        try:
            with _lease(lb, job.id, worker, lease_ms):
                process(lb, job, worker)
        except Exception as e:  # an error of the server, not of the run: record it, keep working
            if isinstance(e, CannotCheckHere):
                log.warning("job %s: %s", job.id, e)  # no traceback: the reason says it all
            else:
                log.exception("job %s failed", job.id)
            with lb.Session() as s:
                if queue.finish(s, job.id, worker, error=f"{type(e).__name__}: {e}"):
                    run = s.get(Run, job.run_id)
                    if run.status == "verifying":
                        run.status, run.reason = "pending", f"the server could not verify it: {type(e).__name__}: {e}"
                s.commit()
        done += 1
    return done
