"""What a server does when it starts, after a crash or not: the database is the truth, and
everything the store holds that no committed row names is a leftover of a write that never got its
commit (the order is always "write the objects, then commit the row that makes them visible").

* A submitted run left pending by a certification the server could not run gets a new one.
* Jobs held by workers that no longer exist go back to the queue: this host's workers whose
  process is gone at once, any other host's once their lease (a minute) has run out. A run is
  "verifying" only while a live worker holds its job.
* Uploads that never became a submission (``incoming/``, and with S3 the bucket's ``incoming/``
  objects and unfinished multipart uploads), a run's objects and unpacked bundle
  where its row records no submission, and online uploads no row names are removed once older
  than a bound (an upload in flight on another server that shares the store is younger than it).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from ..store import remove_path
from . import queue
from .db import Job, OnlineStep, OnlineWindow, Run
from .service import Leaderboard

log = logging.getLogger("witness.leaderboard")

ORPHAN_AFTER_S = 3600.0


@dataclass
class Recovered:
    """What a start put right."""

    jobs_released: int = 0
    runs_settled: int = 0
    certifications_requeued: int = 0
    uploads_removed: int = 0
    run_folders_removed: int = 0
    online_removed: int = 0

    def __bool__(self) -> bool:
        return any(vars(self).values())


def _process_gone(worker: str | None, host: str) -> bool:
    """Whether ``worker`` ("host:pid") is a process of this host that no longer runs."""
    if not worker or worker.rpartition(":")[0] != host:
        return False
    try:
        pid = int(worker.rpartition(":")[2])
    except ValueError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive, and not ours to judge
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    # a reused pid: a process that is no witness worker holds no job
    return cmdline.exists() and b"witness" not in cmdline.read_bytes()


def recover(lb: Leaderboard, orphan_after_s: float = ORPHAN_AFTER_S) -> Recovered:
    """Release dead workers' jobs and remove what no committed row names (see the module)."""
    done = Recovered()
    host = socket.gethostname()
    with lb.Session() as s:
        holders = set(s.scalars(select(Job.worker).where(Job.status == "running")))
        for w in sorted(w for w in holders if _process_gone(w, host)):
            done.jobs_released += queue.release_worker(s, w)
        done.jobs_released += queue.requeue_expired(s)
        done.runs_settled = queue.settle_runs(s)
        # a submitted run whose certification failed for the server's reasons (a worker that could not replay
        # it: no sandbox, another torch) is certified again by the workers of this start; nothing was decided
        open_jobs = select(Job.run_id).where(Job.kind == "certify", Job.status.in_(("queued", "running")))
        for run_id in s.scalars(select(Run.id).where(Run.status == "pending", Run.bundle_sha256.is_not(None),
                                                     Run.id.not_in(open_jobs))).all():
            queue.enqueue(s, run_id, "certify", lb.settings.certify_challenges)
            done.certifications_requeued += 1
        s.commit()
        submitted = set(s.scalars(select(Run.id).where(Run.bundle_sha256.is_not(None))))
        rows = s.execute(select(OnlineStep.run_id, OnlineStep.step, OnlineStep.state_sha256,
                                OnlineStep.has_samples)).all()
        windows = s.execute(select(OnlineWindow.run_id, OnlineWindow.size, OnlineWindow.sha256)).all()
    # an online upload is named "<step>.<sha256>.<suffix>": a state is its row's, samples a row's that have
    # them, a window's openings its row's
    kept = {(r, "states", f"{t:08d}.{sha}") for r, t, sha, _ in rows if sha} | \
        {(r, "samples", f"{t:08d}") for r, t, _, has in rows if has} | \
        {(r, "chunks", f"{size:08d}.{sha}") for r, size, sha in windows}
    store = lb.store
    done.uploads_removed = store.sweep_incoming(orphan_after_s)
    now = time.time()
    # a run's objects and its unpacked bundle here, by run, with when they were last written
    objects: dict[int, list[str]] = {}
    newest: dict[int, float] = {}
    for key, modified in list(store.keys("runs/")):
        run_id = key.split("/")[1]
        if run_id.isdigit():
            objects.setdefault(int(run_id), []).append(key)
            newest[int(run_id)] = max(newest.get(int(run_id), 0.0), modified)
    bundles = store.local_bundle_root(0).parent
    for p in bundles.iterdir() if bundles.is_dir() else []:
        if p.name.isdigit():
            newest[int(p.name)] = max(newest.get(int(p.name), 0.0), p.lstat().st_mtime)
    for run_id, when in sorted(newest.items()):
        if run_id not in submitted and now - when >= orphan_after_s:
            for key in objects.get(run_id, []):
                store.delete(key)
            remove_path(store.local_bundle_root(run_id))
            done.run_folders_removed += 1
    for key, modified in list(store.keys("online/")):
        _, run_id, kind, name = (key.split("/") + ["", "", "", ""])[:4]
        name = name.rsplit(".", 1)[0] if kind in ("states", "chunks") else name.split(".", 1)[0]
        if not (run_id.isdigit() and (int(run_id), kind, name) in kept) and now - modified >= orphan_after_s:
            store.delete(key)
            done.online_removed += 1
    if done:
        log.warning("recovered at start: %s", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in vars(done).items()
                                                          if v))
    return done
