"""The job queue, kept in the database so that workers on many machines share it.

Online jobs are claimed before the others, then the oldest first. PostgreSQL: a worker claims a job with ``SELECT … FOR UPDATE SKIP LOCKED``, so concurrent
workers never wait on each other and never take the same job. SQLite: one ``UPDATE …
RETURNING`` statement claims a job atomically (SQLite serialises writers). A claimed job holds
a lease that its worker renews while it works (every third of it); a job whose worker died is
queued again once its lease has expired, so nothing is lost, and a long verification is not taken
up a second time. A run whose job goes back to the queue goes back to "pending": a run is
"verifying" only while a worker holds its job.
"""

from __future__ import annotations

from sqlalchemy import case, exists, select, text, update
from sqlalchemy.orm import Session

from .db import Job, Run, now_ms

# A worker renews its lease every 20 s: one that stopped for a minute is gone, and its job is
# queued again (a worker that comes back finds it decided by another: finish() refuses it).
LEASE_MS = 60 * 1000
# Online jobs go first: they replay a few steps of a run that is still training, whose trainer
# learns of a failure only from the server, and each takes a moment beside a certification.
ONLINE_FIRST = case((Job.kind == "online", 0), else_=1)


def enqueue(s: Session, run_id: int, kind: str, count: int, requested_by: int | None = None) -> Job:
    """Add a job (the caller commits)."""
    job = Job(run_id=run_id, kind=kind, count=count, requested_by=requested_by, status="queued",
              attempts=0, created_ms=now_ms())
    s.add(job)
    s.flush()
    return job


def claim(s: Session, worker: str) -> Job | None:
    """Take the oldest queued job for ``worker``, or None; commits the claim."""
    t = now_ms()
    if s.get_bind().dialect.name == "postgresql":
        row = s.execute(
            select(Job).where(Job.status == "queued").order_by(ONLINE_FIRST, Job.id).limit(1)
            .with_for_update(skip_locked=True)
        ).scalar_one_or_none()
        if row is None:
            s.commit()
            return None
        row.status, row.worker, row.claimed_ms, row.attempts = "running", worker, t, row.attempts + 1
        s.commit()
        return row
    job_id = s.execute(
        text("UPDATE jobs SET status = 'running', worker = :w, claimed_ms = :t, attempts = attempts + 1 "
             "WHERE id = (SELECT id FROM jobs WHERE status = 'queued' "
             "ORDER BY CASE WHEN kind = 'online' THEN 0 ELSE 1 END, id LIMIT 1) RETURNING id"),
        {"w": worker, "t": t},
    ).scalar_one_or_none()
    s.commit()
    return None if job_id is None else s.get(Job, job_id, populate_existing=True)


def finish(s: Session, job_id: int, worker: str, error: str | None = None) -> bool:
    """Mark ``worker``'s job done (or failed, with the error) if it still holds it; the caller
    commits with its results, or, on False, rolls them back: the job was queued again (its lease
    ran out) and another worker decides it, so that every job is decided exactly once."""
    n = s.execute(
        update(Job).where(Job.id == job_id, Job.worker == worker, Job.status == "running")
        .values(status="failed" if error else "done", error=error, finished_ms=now_ms())
        .execution_options(synchronize_session=False)
    ).rowcount
    return n == 1


def renew(s: Session, job_id: int, worker: str) -> bool:
    """Extend ``worker``'s lease on a running job (commits); False if the job is no longer its own."""
    n = s.execute(
        update(Job).where(Job.id == job_id, Job.worker == worker, Job.status == "running")
        .values(claimed_ms=now_ms()).execution_options(synchronize_session=False)
    ).rowcount
    s.commit()
    return n == 1


def release_worker(s: Session, worker: str) -> int:
    """Queue again at once the running jobs of ``worker``, known to be dead (its process was
    reaped); returns how many. Its lease need not run out: it can no longer finish them."""
    return _requeue(s, Job.worker == worker)


def requeue_expired(s: Session, lease_ms: int = LEASE_MS) -> int:
    """Queue again the jobs whose worker stopped renewing its lease; returns how many."""
    return _requeue(s, Job.claimed_ms < now_ms() - lease_ms)


def _requeue(s: Session, which) -> int:  # noqa: ANN001 - a SQL condition on jobs
    n = s.execute(
        update(Job).where(Job.status == "running", which)
        .values(status="queued", worker=None).execution_options(synchronize_session=False)
    ).rowcount
    settle_runs(s)
    s.commit()
    return n or 0


def settle_runs(s: Session) -> int:
    """Runs shown as "verifying" whose job no worker holds go back to "pending" (the caller commits)."""
    held = exists().where(Job.run_id == Run.id, Job.status == "running", Job.kind == "certify")
    return s.execute(update(Run).where(Run.status == "verifying", ~held)
                     .values(status="pending").execution_options(synchronize_session=False)).rowcount or 0
