"""The server's verification workers as child processes: a worker that dies is reaped, its jobs
are queued again at once (not after its lease runs out), and a new worker takes its place."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable

from . import queue
from .service import Leaderboard

log = logging.getLogger("witness.leaderboard.serve")

# A worker that dies this soon after it started is failing to start, not killed at work:
# wait before the next try, doubling up to a minute, rather than restart it in a tight loop.
QUICK_DEATH_S = 10.0
MAX_BACKOFF_S = 60.0


class WorkerPool:
    """``n`` worker processes made by ``spawn``, watched every ``poll_s`` seconds."""

    def __init__(self, lb: Leaderboard, spawn: Callable[[], subprocess.Popen], n: int, poll_s: float = 1.0):
        self.lb, self.spawn, self.poll_s = lb, spawn, poll_s
        self.procs = [spawn() for _ in range(n)]
        self.started = [time.monotonic()] * n
        self.backoff = [0.0] * n
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="worker-pool", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for i in range(len(self.procs)):
                try:
                    self._check(i)
                except Exception:  # the database may be briefly away: try again at the next poll
                    log.exception("could not replace worker %d", i)

    def _check(self, i: int) -> None:
        p = self.procs[i]
        code = p.poll()  # reaps a dead child: no zombie is left
        if code is None or self._stop.is_set():
            return
        now = time.monotonic()
        if now - self.started[i] < QUICK_DEATH_S:
            self.backoff[i] = min(MAX_BACKOFF_S, max(1.0, 2 * self.backoff[i]))
        else:
            self.backoff[i] = 0.0
        if now < self.started[i] + self.backoff[i]:
            return
        with self.lb.Session() as s:
            released = queue.release_worker(s, f"{socket.gethostname()}:{p.pid}")
        log.warning("worker pid %d exited with code %s; %d job(s) it held queued again; starting a new worker",
                    p.pid, code, released)
        self.procs[i] = self.spawn()
        self.started[i] = time.monotonic()
        self.restarts += 1

    def stop(self, timeout: float = 30.0) -> None:
        """Stop watching, then stop every worker."""
        self._stop.set()
        self._thread.join()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
