"""``witness leaderboard demo``: a fresh local leaderboard with real certified runs and a rejected one.

Its scale-out variant (``--db postgresql://… --store s3://… --workers N``) is the same demo with the
leaderboard's objects in an S3-compatible object store and its certification done by N worker
processes (``witness leaderboard worker``), each with a working folder of its own, sharing nothing
with the server but the database and the bucket, as workers on other machines would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select

from ..beacon.db import BeaconBase
from ..beacon.witness_db import WitnessBase
from ..commit.signing import generate_key, public_hex, save_key
from ..database import shown_url
from . import client as C
from .db import Account, Base, Job
from .service import Leaderboard, Settings
from .tracks import DEFAULT_TRACKS
from .worker import work

DEMO_TRACK = "tiny-mlp"
ONLINE_TRACK = "tiny-mlp-online"  # the same recipe, audited online while it trains


def start_server(lb: Leaderboard, host: str = "127.0.0.1", port: int = 8080):
    """uvicorn serving the leaderboard in a background thread; returns (server, thread, base URL)."""
    from ..web import start_uvicorn
    from .app import create_app

    return start_uvicorn(create_app(lb=lb), host, port)


# What each demo submitter says of its run (the recipe is the track's: only the seed differs).
DEMO_INFO = {
    "alice": {"title": "baseline", "description": "the track's recipe as registered"},
    "bob": {"title": "baseline, second seed", "description": "the same recipe under another ticket's seed",
            "code_url": "https://example.org/bob/tiny-mlp"},
    "carol": {"title": "baseline, third seed"},
    "mallory": {"title": "faster warm-up", "description": "claims the registered schedule; trained with a secretly "
                                                          "larger learning rate"},
    "dave": {"title": "baseline, audited online", "description": "the recipe on the online track: replayed while it trained"},
    "eve": {"title": "faster warm-up, audited online", "description": "mallory's trick on the online track"},
}


def train_run(url: str, token: str, key, out: Path, track: str, lr_cheat: float = 1.0,  # noqa: ANN001 - key
              checkpoint_every: int = 10, info: dict | None = None) -> int:
    """Take a ticket, train while streaming heads, evaluate and submit; returns the run id.

    ``lr_cheat`` != 1 makes a dishonest trainer: it trains the middle third of the run with a
    scaled learning rate while logging the schedule's, which the server's replay must catch.
    """
    factor = None if lr_cheat == 1.0 else (lambda t, n: lr_cheat if n // 3 <= t < 2 * n // 3 else 1.0)
    online = track == ONLINE_TRACK
    with C.connect(url, token) as c:
        try:
            run_id, _ = C.train_ticketed(c, track, key, out,
                                         C.TicketedRun(checkpoint_every=checkpoint_every, lr_factor=factor,
                                                       online=online), info=info)
        except C.BeaconError as e:  # rejected while it trained: the server refused its next head
            print(f"  the server stopped a run on {track} while it trained: {e}", file=sys.stderr)
            mine = C._ok(c.get(f"/api/tracks/{track}/runs", params={"sort": "id", "status": "rejected"}))["runs"]
            return mine[0]["id"]
        return C.submit(c, out, C.write_evaluation(out, key, out.with_suffix(".eval.json")))["run_id"]


def _fresh_folder(folder: Path) -> bool:
    """Make ``folder`` afresh, unless it is there and holds no earlier demo (then say so)."""
    if folder.exists():
        if not ((folder / "store").is_dir() or (folder / "server-work").is_dir()):
            print(f"{folder} exists and is not a leaderboard demo; choose another --dir", file=sys.stderr)
            return False
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return True


def _local(folder: Path, tracks: tuple) -> Leaderboard | None:
    """The embedded default: SQLite and a store folder inside ``folder`` (made afresh)."""
    if not _fresh_folder(folder):
        return None
    return Leaderboard(Settings(db_url=f"sqlite:///{(folder / 'leaderboard.db').resolve()}", store=folder / "store",
                                tracks=tracks, registrations_per_hour=len(DEMO_INFO)))  # its six people, on loopback


def _scaled(folder: Path, tracks: tuple, db: str, store: str, reset: bool) -> Leaderboard | None:
    """The scale-out variant's server: PostgreSQL and an S3 store, refused unless both are empty (or
    ``reset``: then emptied, the database's rows and the prefix's objects)."""
    if not _fresh_folder(folder):
        return None
    settings = Settings(db_url=db, store=store, work=folder / "server-work", server_key=folder / "server_key.pem",
                        tracks=tracks, registrations_per_hour=len(DEMO_INFO))
    lb = Leaderboard(settings, sync_tracks=False)
    with lb.Session() as s:
        used = s.scalar(select(func.count()).select_from(Account)) or 0
    objects = next(iter(lb.store.keys("")), None) is not None
    if (used or objects) and not reset:
        print(f"the database or {store} holds a leaderboard already; give empty ones, or --reset to empty them",
              file=sys.stderr)
        lb.engine.dispose()
        return None
    if reset:
        keys = list(lb.store.keys(""))
        if used or keys:  # said before it is done: the demo never empties anything without a word
            print(f"--reset: emptying the database {shown_url(db)} ({used} account(s) and their runs) and "
                  f"{store} ({len(keys)} object(s))", file=sys.stderr)
        with lb.Session() as s:
            for table in [*reversed(Base.metadata.sorted_tables), *reversed(WitnessBase.metadata.sorted_tables),
                          *reversed(BeaconBase.metadata.sorted_tables)]:
                s.execute(table.delete())
            s.commit()
        for key, _ in keys:
            lb.store.delete(key)
    lb.sync_tracks()
    return lb


def start_workers(lb: Leaderboard, folder: Path, n: int) -> list[subprocess.Popen]:
    """``n`` worker processes on the server's database and store, a working folder each; they stop
    when this process does."""
    s = lb.settings
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "witness.cli", "leaderboard", "worker", "--db", s.db_url, "--store", str(s.store),
               "--work", str(folder / f"worker-{i}"), "--server-key", str(s.server_key), "--parent", str(os.getpid())]
        with open(folder / f"worker-{i}.log", "ab") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    return procs


def drain(lb: Leaderboard, procs: list[subprocess.Popen], timeout_s: float = 1800) -> None:
    """Wait until the worker processes have taken and finished every job."""
    deadline = time.monotonic() + timeout_s
    while True:
        with lb.Session() as s:
            left = s.scalar(select(func.count()).select_from(Job).where(Job.status.in_(("queued", "running"))))
        if not left:
            return
        if not any(p.poll() is None for p in procs):
            raise RuntimeError("every demo worker stopped with jobs left: see worker-*.log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{left} job(s) left after {timeout_s:.0f} s")
        time.sleep(0.2)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(folder: Path, port: int = 8080, serve: bool = True, db: str | None = None, store: str | None = None,
             workers: int = 1, reset: bool = False) -> int:
    """Fill a fresh leaderboard in ``folder`` and (unless ``serve`` is False) serve it until Ctrl-C;
    with ``store`` an s3:// URL (and ``db`` PostgreSQL), the scale-out variant with ``workers``
    worker processes."""
    tracks = tuple(t for t in DEFAULT_TRACKS if t.name in (DEMO_TRACK, ONLINE_TRACK))
    scaled = store is not None
    if scaled and not (str(store).startswith("s3://") and db):
        print("the scale-out demo takes --store s3://BUCKET/PREFIX and --db postgresql://…", file=sys.stderr)
        return 2
    lb = _scaled(folder, tracks, db, store, reset) if scaled else _local(folder, tracks)
    if lb is None:
        return 2
    server, thread, url = start_server(lb, port=port)
    print(f"leaderboard at {url}; training and submitting runs on track {DEMO_TRACK}", file=sys.stderr)
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    # SIGTERM stops the demo as Ctrl-C does: its worker processes and its server with it
    main = threading.current_thread() is threading.main_thread()  # (only it may set a handler)
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        procs.extend(start_workers(lb, folder, workers) if scaled else [])
        if scaled:
            print(f"  {workers} worker process(es) certify, sharing only the database and {store}", file=sys.stderr)
        # the server's worker (the embedded default) or the worker processes: every job done
        certify: Callable[[], object] = (lambda: drain(lb, procs)) if scaled else (lambda: work(lb, once=True))
        people = {}
        for name in ("alice", "bob", "carol", "mallory", "dave", "eve"):
            key = generate_key()
            save_key(key, folder / "keys" / f"{name}.pem")
            with C.connect(url) as c:
                people[name] = (key, C.register(c, name, public_hex(key.public_key()))["token"])
        runs = {}
        for name in ("alice", "bob", "carol", "mallory"):
            key, token = people[name]
            runs[name] = train_run(url, token, key, folder / "runs" / name, DEMO_TRACK,
                                   lr_cheat=1.5 if name == "mallory" else 1.0, info=DEMO_INFO[name])
            print(f"  {name}: trained and submitted run {runs[name]}", file=sys.stderr)
        certify()  # the server's worker: draws challenges, replays, checks the evaluation
        # On the online track the server's worker replays the steps its beacon selected as their
        # states arrive, while the run trains (a worker thread, as `serve` runs worker processes).
        stop_online = threading.Event()
        online_worker = threading.Thread(target=work, args=(lb,), kwargs={"stop": stop_online.is_set, "poll_s": 0.1},
                                         daemon=True)
        if not scaled:  # the worker processes are at it already
            online_worker.start()
        for name in ("dave", "eve"):
            key, token = people[name]
            runs[name] = train_run(url, token, key, folder / "runs" / name, ONLINE_TRACK,
                                   lr_cheat=1.5 if name == "eve" else 1.0, info=DEMO_INFO[name])
            print(f"  {name}: trained run {runs[name]} on {ONLINE_TRACK}", file=sys.stderr)
        stop_online.set()
        if not scaled:
            online_worker.join()
        certify()  # the online runs' certification: what was not replayed while they trained
        with C.connect(url, people["bob"][1]) as c:
            C.challenge(c, runs["alice"], 30)  # bob doubts alice's run and asks for more challenges
        certify()
        print(f"  bob asked for 30 more challenges on alice's run {runs['alice']}", file=sys.stderr)
        with C.connect(url) as c:
            for name, run_id in runs.items():
                r = c.get(f"/api/runs/{run_id}").json()
                value = f"{r['metric']} {r['metric_value']:.4f}" if r["metric_value"] is not None else ""
                passed = f"{r['challenges_passed']} challenges passed, bound {r['bound']:.4f}" if r["status"] == "certified" else ""
                o = r["online"]
                live = f"{o['while_training']} of {o['selected']} selected steps replayed while it trained" if o else ""
                parts = [r["status"].upper(), value, passed, live, r["reason"] or ""]
                print(f"  run {run_id} by {name}: " + ", ".join(p for p in parts if p))
        print(f"open {url}/tracks/{DEMO_TRACK} and {url}/tracks/{ONLINE_TRACK} (API docs at {url}/docs)")
        if serve and not scaled:
            threading.Thread(target=work, args=(lb,), kwargs={"stop": stop.is_set}, daemon=True).start()
        while serve and thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        server.should_exit = True
        thread.join()
        stop.set()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        lb.engine.dispose()
    return 0
