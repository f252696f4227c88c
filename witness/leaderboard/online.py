"""Online tracks: the server's workers replay the steps its beacon selected while the run trains.

A run with online challenges streams each head with the records it newly covers, and uploads
the state before every selected step and its batch's samples as the statement arrives. Once both
are here the step is queued; a worker then builds the run's bundle as far as it is signed (log,
heads, the server's own statements, the uploads, the track's dataset leaves) and runs the online
audit on the steps that are ready, skipping the rest. Everything cheap is checked in full again
each time; a failed step rejects the run at once, in public, while it is still training.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from sqlalchemy import select, update

from ..bundle.checkpoint import safetensors_header
from ..bundle.layout import (
    HEADS,
    LEAVES,
    LOG,
    MARKER,
    ONLINE_CHUNKS,
    STATEMENTS,
    marker_bytes,
    online_chunks_name,
    online_samples_name,
    online_state_name,
)
from ..commit.signing import SignedTreeHead
from ..errors import MalformedInput, RunRejected, VerificationError
from ..store import link_or_copy, online_key, online_prefix
from ..task.registry import build_task
from ..verify.audit import LiveRound, Verifier, verify_round
from ..verify.policy import Policy, Trust
from . import queue
from .certification import record_decision
from .db import (
    Account,
    ChallengeRow,
    Head,
    Job,
    LogLine,
    OnlineStep,
    OnlineWindow,
    Round,
    Run,
    Track,
    now_ms,
    run_manifest,
)
from .service import Leaderboard


def track_leaves(lb: Leaderboard, track: Track) -> Path:
    """The track's dataset leaves, written once from the registered task's own dataset."""
    path = lb.store.leaves_file(track.data_root)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        dataset = build_task(track.task, json.loads(track.config_json)).dataset()
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        dataset.leaves.write(tmp, bytes.fromhex(track.data_root))
        os.replace(tmp, path)
    return path


def live_bundle(lb: Leaderboard, s, run: Run, ready: list[OnlineStep], dest: Path,  # noqa: ANN001 - a Session
                windows: list[OnlineWindow] = ()) -> Path:
    """The run's bundle as far as its streamed heads sign it, with the uploads of the ``ready``
    steps and the chunk openings of ``windows`` (those the signed log covers), under ``dest``.

    The final head is left out: a finished bundle must carry its final checkpoint, which only the
    submission brings (its last window is replayed by the certification)."""
    heads = _live_heads(s, run)
    size = heads[-1].size
    lines = s.scalars(select(LogLine.line).where(LogLine.run_id == run.id, LogLine.position < size)
                      .order_by(LogLine.position))
    dest.mkdir(parents=True)
    (dest / MARKER).write_bytes(marker_bytes())
    (dest / LOG).write_bytes(b"".join(line.encode() + b"\n" for line in lines))
    (dest / HEADS).write_bytes(b"".join(h.head_json.encode() + b"\n" for h in heads))
    (dest / STATEMENTS).parent.mkdir(parents=True)
    (dest / STATEMENTS).write_bytes(b"".join(line + b"\n" for line in lb.statements(s, run, size)))
    for row in ready:
        lb.store.fetch(online_key(run.id, "states", row.step, row.state_sha256), dest / online_state_name(row.step))
        lb.store.fetch(_samples_of(lb, run.id, row.step), dest / online_samples_name(row.step))
    for w in windows:
        if w.size <= size:
            (dest / ONLINE_CHUNKS).mkdir(parents=True, exist_ok=True)
            lb.store.fetch(online_key(run.id, "chunks", w.size, w.sha256), dest / online_chunks_name(w.size))
    link_or_copy(track_leaves(lb, s.get(Track, run.track)), dest / LEAVES)
    return dest


def _live_heads(s, run: Run) -> list[Head]:  # noqa: ANN001 - a Session
    """The run's streamed heads short of its final one (which needs the final checkpoint)."""
    return [h for h in s.scalars(select(Head).where(Head.run_id == run.id).order_by(Head.size))
            if SignedTreeHead.from_json(json.loads(h.head_json)).extensions is None]


def _samples_of(lb: Leaderboard, run_id: int, step: int) -> str:
    """The key of the samples uploaded for a step (one per step: a second upload is refused)."""
    prefix = f"{online_prefix(run_id, 'samples')}{step:08d}."
    found = sorted(k for k, _ in lb.store.keys(prefix) if k.endswith(".json"))
    if not found:
        raise VerificationError("the samples of this selected step are missing on the server", step=step,
                                check="online")
    return found[0]


def process_online(lb: Leaderboard, job: Job, worker: str) -> None:
    """Replay the run's selected steps whose uploads are complete; a failure rejects the run (commits)."""
    with lb.Session() as s:
        job = s.get(Job, job.id)
        run = s.get(Run, job.run_id)
        ready = list(s.scalars(select(OnlineStep).where(OnlineStep.run_id == run.id, OnlineStep.status == "ready")
                               .order_by(OnlineStep.step)))
        # the windows whose chunk openings came and no round checked yet (each checked once, as it comes)
        windows = list(s.scalars(select(OnlineWindow).where(OnlineWindow.run_id == run.id,
                                                            OnlineWindow.status == "uploaded")
                                 .order_by(OnlineWindow.size)))
        if not (ready or windows) or run.status != "ticketed":
            # nothing new, or the run was submitted (its certification replays what is not yet passed)
            return _close(s, job, worker)
        if len(_live_heads(s, run)) < 2:  # nothing but the manifest is signed short of the final head
            return _close(s, job, worker)
        acct = s.get(Account, run.account_id)
        # replay exactly the ready steps: a statement may select steps whose rows are not written
        # yet (the beacon commits its statement first), and those wait for their uploads too
        planned = run_manifest(s, run.id)["steps_planned"]
        others = set(range(planned)) - {row.step for row in ready}
        verdict, failures, unreadable = None, [], None
        with tempfile.TemporaryDirectory(dir=lb.store.root / "incoming", prefix="live-") as tmp:
            try:
                bundle = live_bundle(lb, s, run, ready, Path(tmp) / "bundle", windows)
                unreadable = _unreadable_openings(Path(tmp) / "bundle", windows)
                if unreadable is not None:
                    failures = [unreadable[1]]
                else:
                    # windows whose openings are not here (checked by an earlier round, or still coming) wait
                    trust = Trust(signer=acct.public_key, ticket=bytes.fromhex(run.r), **lb.online_trust(s, run))
                    policy = Policy(mode="online", bad_fraction=lb.settings.bad_fraction)
                    verdict = verify_round(Verifier(trust, policy), bundle, None,
                                           LiveRound(skip=others, pending_openings=True))
            except RunRejected as e:
                verdict, failures = e.verdict, list(e.failures)
            except VerificationError as e:  # MalformedInput too: an upload the audit cannot read
                failures = [str(e)]
        # only the steps replayed are decided: a ready step past the live log's last head (the
        # final window) waits for the certification
        results = {r.step: r for r in (verdict.results if verdict is not None else [])}
        evidence = {e.step: e for e in (verdict.ledger if verdict is not None else [])}
        rnd = Round(run_id=run.id, job_id=job.id, kind="online", requested_by=None, nonce="", count=0, passed=False,
                    bound=verdict.detection_probability if verdict else 0.0, detail="", worker=worker,
                    finished_ms=now_ms())
        s.add(rnd)
        s.flush()
        # Two online jobs of one run (one queued while another runs, on two workers) read the same
        # ready rows and both replay them. Each step is decided once, by the round whose conditional
        # update takes it from "ready": the other round leaves it out, so no step is listed (or
        # counted) twice in the run's challenge history.
        replayed = []
        for row in ready:
            r = results.get(row.step)
            if r is None:
                continue
            taken = s.execute(update(OnlineStep).where(OnlineStep.id == row.id, OnlineStep.status == "ready").values(
                status="passed" if r.passed else "failed", round_id=rnd.id, failure=r.failure,
                # what the certification counts without replaying it
                ledger_json=json.dumps(evidence[row.step].to_json()) if r.passed and row.step in evidence else None,
            ).execution_options(synchronize_session=False)).rowcount
            if taken:
                replayed.append((row, r))
                s.add(ChallengeRow(round_id=rnd.id, step=row.step, length=1, passed=r.passed,
                                   distances_json=json.dumps(r.distances), failure=r.failure))
        failed = {t for t, r in results.items() if not r.passed}
        # a window's openings that did not hold (a coordinate out of bounds, a path to another root): the window
        moved = unreadable[0] if unreadable is not None else \
            (verdict.moves or {}).get("failed_window") if verdict is not None and failures else None
        if failures and failed and not failed & {row.step for row, _ in replayed} and moved is None:
            failures = []  # the steps that failed were another round's to decide: it rejects the run on them
        passed = not failures
        # the windows whose every step's opened moves this round checked (each taken once, from "uploaded")
        # (a failed check's moves hold only where it failed: no window of it counts as checked)
        sizes = set(verdict.moves.get("sizes", ())) if passed and verdict is not None and verdict.moves else set()
        checked = [w for w in windows if w.size in sizes and s.execute(
            update(OnlineWindow).where(OnlineWindow.id == w.id, OnlineWindow.status == "uploaded")
            .values(status="checked", round_id=rnd.id).execution_options(synchronize_session=False)).rowcount]
        if passed and not replayed and not checked:  # nothing new: another round decided these (or nothing was here)
            s.rollback()
            return _close(s, job, worker)
        rnd.count, rnd.passed = sum(1 for _, r in replayed if r.passed), passed
        rnd.detail = "; ".join(failures) if failures else "; ".join(
            ([f"steps {', '.join(str(row.step) for row, _ in replayed)} replayed as their states arrived: all matched"]
             if replayed else []) +
            ([f"every step of {len(checked)} window(s) ({sum(w.steps for w in checked)} step(s)): the opened chunks "
              "moved within the optimizer's bound"] if checked else []))
        if failures:
            bad = next((row for row, r in replayed if not r.passed), None)
            where = f"step {bad.step}" if bad is not None else \
                "the chunk openings of a window" if moved is not None else "its streamed log"
            reason = f"online challenge failed while the run trained ({where}): " + "; ".join(failures)
            t = now_ms()
            # only a run still training is decided here: a submitted one is decided by its certification
            decided = s.execute(update(Run).where(Run.id == run.id, Run.status == "ticketed")
                                .values(status="rejected", reason=reason, decided_ms=t, submitted_ms=t)
                                .execution_options(synchronize_session=False)).rowcount
            if decided:
                s.refresh(run)
                window = next((w for w in windows if w.size == moved), None) if bad is None else None
                if bad is not None:  # the decision names the uploaded state the step failed from
                    subject = {"name": f"run-{run.id}-state-{bad.step:08d}.safetensors",
                               "digest": {"sha256": bad.state_sha256}}
                elif window is not None:  # or the openings that showed a coordinate moving too far
                    s.execute(update(OnlineWindow).where(OnlineWindow.id == window.id).values(status="failed",
                                                                                             round_id=rnd.id))
                    subject = {"name": f"run-{run.id}-chunks-{window.size:08d}.safetensors",
                               "digest": {"sha256": window.sha256}}
                else:  # or the streamed log's last head
                    subject = {"name": f"run-{run.id}-log-{heads_size(s, run.id)}", "digest": {"sha256": last_root(s, run.id)}}
                record_decision(lb, s, run, rnd, verdict, None, subjects=[subject])
        if not queue.finish(s, job.id, worker):
            s.rollback()
            return
        s.commit()


def _unreadable_openings(bundle: Path, windows: list[OnlineWindow]) -> tuple[int, str] | None:
    """The size of the first window whose uploaded openings are not a safetensors file, and why: the audit
    would refuse them as unreadable input, and the decision must name that file, not the run's log."""
    for w in windows:
        path = bundle / online_chunks_name(w.size)
        if not path.exists():  # past the signed log: this round leaves it
            continue
        try:
            safetensors_header(path)
        except MalformedInput as e:
            return w.size, f"the chunk openings of the window closing at size {w.size} are not a safetensors file: {e}"
    return None


def _close(s, job: Job, worker: str) -> None:  # noqa: ANN001 - a Session
    """End a job that decided nothing (commits)."""
    if queue.finish(s, job.id, worker):
        s.commit()


def heads_size(s, run_id: int) -> int:  # noqa: ANN001 - a Session
    """The size of a run's last streamed head."""
    return s.scalar(select(Head.size).where(Head.run_id == run_id).order_by(Head.size.desc()).limit(1))


def last_root(s, run_id: int) -> str:  # noqa: ANN001 - a Session
    """The root (hex) of a run's last streamed head."""
    return s.scalar(select(Head.root).where(Head.run_id == run_id).order_by(Head.size.desc()).limit(1))


OPEN = ("ticketed", "pending", "verifying")  # a run whose online audit may still go on


def online_progress(s, run: Run) -> dict:  # noqa: ANN001 - a Session
    """How far the online audit of a run has come: steps selected, uploaded, replayed and failed.

    Only a run still open (training, or submitted and not yet decided) has work pending: a decided
    run's selected steps that were never replayed are ``not_replayed``, never "being replayed" or
    "awaiting their state" (a rejected run's uploads are closed, and no worker takes them up)."""
    rows = s.execute(select(OnlineStep.status, Round.kind).outerjoin(Round, OnlineStep.round_id == Round.id)
                     .where(OnlineStep.run_id == run.id)).all()
    count = {k: sum(1 for st, _ in rows if st == k) for k in ("selected", "ready", "passed", "failed")}
    live = sum(1 for st, kind in rows if st == "passed" and kind == "online")
    open_ = run.status in OPEN
    # a chunked run's windows: their openings uploaded, and the steps a live round checked every move of
    windows = s.execute(select(OnlineWindow.status, OnlineWindow.steps).where(OnlineWindow.run_id == run.id)).all()
    chunks = (run_manifest(s, run.id).get("online") or {}).get("chunks", 0)
    return {"selected": len(rows), "waiting": count["selected"] if open_ else 0,
            "ready": count["ready"] if open_ else 0, "verified": count["passed"], "failed": count["failed"],
            "while_training": live, "at_submission": count["passed"] - live,
            "not_replayed": 0 if open_ else count["selected"] + count["ready"],
            "chunks": chunks, "windows": len(windows), "moves_checked": sum(n for st, n in windows if st == "checked"),
            "moves_failed": sum(1 for st, _ in windows if st == "failed")}
