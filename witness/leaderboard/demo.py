"""``witness leaderboard demo``: a fresh local leaderboard with real certified runs and a rejected one."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

from ..commit.signing import generate_key, public_hex, save_key
from . import client as C
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
            run_id, _ = C.train_ticketed(c, track, key, out, checkpoint_every=checkpoint_every, lr_factor=factor,
                                         info=info, online=online)
        except C.BeaconError as e:  # rejected while it trained: the server refused its next head
            print(f"  the server stopped a run on {track} while it trained: {e}", file=sys.stderr)
            mine = C._ok(c.get(f"/api/tracks/{track}/runs", params={"sort": "id", "status": "rejected"}))["runs"]
            return mine[0]["id"]
        return C.submit(c, out, C.write_evaluation(out, key, out.with_suffix(".eval.json")))["run_id"]


def run_demo(folder: Path, port: int = 8080, serve: bool = True) -> int:
    """Fill a fresh leaderboard in ``folder`` and (unless ``serve`` is False) serve it until Ctrl-C."""
    if folder.exists():
        if not (folder / "store").is_dir():
            print(f"{folder} exists and is not a leaderboard demo; choose another --dir", file=sys.stderr)
            return 2
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tracks = tuple(t for t in DEFAULT_TRACKS if t.name in (DEMO_TRACK, ONLINE_TRACK))
    lb = Leaderboard(Settings(db_url=f"sqlite:///{(folder / 'leaderboard.db').resolve()}", store=folder / "store",
                              tracks=tracks, registrations_per_hour=len(DEMO_INFO)))  # its six people, on loopback
    server, thread, url = start_server(lb, port=port)
    print(f"leaderboard at {url}; training and submitting runs on track {DEMO_TRACK}", file=sys.stderr)
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
    work(lb, once=True)  # the server's worker: draws challenges, replays, checks the evaluation
    # On the online track the server's worker replays the steps its beacon selected as their
    # states arrive, while the run trains (a worker thread, as `serve` runs worker processes).
    stop_online = threading.Event()
    online_worker = threading.Thread(target=work, args=(lb,), kwargs={"stop": stop_online.is_set, "poll_s": 0.1},
                                     daemon=True)
    online_worker.start()
    for name in ("dave", "eve"):
        key, token = people[name]
        runs[name] = train_run(url, token, key, folder / "runs" / name, ONLINE_TRACK,
                               lr_cheat=1.5 if name == "eve" else 1.0, info=DEMO_INFO[name])
        print(f"  {name}: trained run {runs[name]} on {ONLINE_TRACK}", file=sys.stderr)
    stop_online.set()
    online_worker.join()
    work(lb, once=True)  # the online runs' certification: what was not replayed while they trained
    with C.connect(url, people["bob"][1]) as c:
        C.challenge(c, runs["alice"], 30)  # bob doubts alice's run and asks for more challenges
    work(lb, once=True)
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
    if not serve:
        server.should_exit = True
        thread.join()
        return 0
    stop = threading.Event()
    worker = threading.Thread(target=work, args=(lb,), kwargs={"stop": stop.is_set}, daemon=True)
    worker.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        server.should_exit = True
    stop.set()
    return 0
