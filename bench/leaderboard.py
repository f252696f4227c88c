"""Leaderboard: verification throughput per worker, and page latency with 1,000 runs in the database.

Throughput: runs of two tracks are trained and submitted to a real server, then one worker
certifies them; the figure is certified runs per hour per worker, with the verification time
as a ratio of the training time measured in the same run. Latency: 1,000 runs are written to
the database (SQLite, and PostgreSQL when --pg is given) and the pages a visitor opens are
requested over HTTP from a uvicorn server: p50 and p95 of 200 requests each.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import parser, report

from witness.commit.signing import generate_key, public_hex
from witness.leaderboard import client as C
from witness.leaderboard.db import Account, ChallengeRow, Job, Round, Run, now_ms
from witness.leaderboard.demo import start_server, train_run
from witness.leaderboard.service import Leaderboard, Settings
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work

TRACKS = {"tiny-mlp": ("tiny-mlp=tiny@accuracy+", 10), "tinygpt-100": ("tinygpt-100=tinygpt:steps=100@bits_per_byte-", 50)}


def throughput(tmp: Path, runs: dict[str, int]) -> dict:
    """Train and submit runs, then time one worker certifying them."""
    lb = Leaderboard(Settings(db_url=f"sqlite:///{tmp / 'tp.db'}", store=tmp / "tp-store",
                              tracks=tuple(parse_track(TRACKS[t][0]) for t in runs)))
    server, thread, url = start_server(lb, port=0)
    key = generate_key()
    with C.connect(url) as c:
        token = C.register(c, "bench", public_hex(key.public_key()))["token"]
    out = {}
    try:
        for track, n in runs.items():
            t0 = time.perf_counter()
            for i in range(n):
                train_run(url, token, key, tmp / f"{track}-{i}", track, checkpoint_every=TRACKS[track][1])
            train_s = (time.perf_counter() - t0) / n  # training + evaluation + upload, per run
            t0 = time.perf_counter()
            done = work(lb, once=True)
            verify_s = (time.perf_counter() - t0) / done
            with C.connect(url) as c:
                statuses = [r["status"] for r in c.get(f"/api/tracks/{track}/runs").json()["runs"]]
            out[track] = {"runs": n, "certified": statuses.count("certified"),
                          "train_eval_submit_s_per_run": round(train_s, 2), "verify_s_per_run": round(verify_s, 2),
                          "runs_per_hour_per_worker": round(3600 / verify_s, 1),
                          "verify_over_train": round(verify_s / train_s, 3)}
            print(track, out[track], file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join()
    return out


VERDICT = {"mode": "offline", "exact": True, "steps": 60, "complete": True, "challenges": 60, "replayed_steps": 60,
           "cost_fraction": 1.0, "checks": ["signatures and log consistency of every signed tree head"] * 8,
           "notes": [], "failures": [], "bad_fraction": 0.05}


def fill(lb: Leaderboard, n: int, track: str) -> list[int]:
    """``n`` decided runs with plausible fields, as the database holds them after verification."""
    rng = random.Random(0)
    t = now_ms()
    with lb.Session() as s:
        accts = [Account(name=f"user{i}", public_key=f"{i:064x}", token_hash=f"{i:064x}", created_ms=t) for i in range(50)]
        s.add_all(accts)
        s.flush()
        for i in range(n):
            status = rng.choices(["certified", "rejected", "revoked", "pending"], [85, 10, 3, 2])[0]
            sub = t - rng.randrange(90 * 86400 * 1000)
            run = Run(account_id=accts[i % 50].id, track=track, r=f"{i:064x}", status=status, ticket_ms=sub - 60000,
                      submitted_ms=sub, decided_ms=sub + 5000, steps=60, final_size=62, final_root="ab" * 32,
                      metric_value=rng.random() if status != "pending" else None, bound=0.99, eval_bound=0.99, challenges_passed=60,
                      reason=None if status == "certified" else "step 12: replay: fingerprint differs",
                      verdict_json=json.dumps(VERDICT), aggregates_json=json.dumps({"examples": 256, "accuracy": 0.9}))
            s.add(run)
            s.flush()
            job = Job(run_id=run.id, kind="certify", count=90, status="done", attempts=1, created_ms=sub)
            s.add(job)
            s.flush()
            rnd = Round(run_id=run.id, job_id=job.id, kind="certify", nonce="00" * 16, count=60, passed=True,
                        bound=0.99, detail="", worker="bench", finished_ms=sub + 5000)
            s.add(rnd)
            s.flush()
            s.add_all(ChallengeRow(round_id=rnd.id, step=k, length=1, passed=True, distances_json="{}") for k in range(60))
        s.commit()
        return [r.id for r in s.query(Run).all()]


def latency(tmp: Path, db_url: str, n: int, requests: int) -> dict:
    """p50/p95 of the pages with ``n`` runs in the database."""
    lb = Leaderboard(Settings(db_url=db_url, store=tmp / "lat-store", tracks=(parse_track("bench=tiny@accuracy+"),)))
    ids = fill(lb, n, "bench")
    server, thread, url = start_server(lb, port=0)
    rng = random.Random(1)
    pages = {
        "track table (best first)": lambda: "/tracks/bench",
        "track table sorted by date, certified only": lambda: "/tracks/bench?sort=submitted&status=certified",
        "track table, last page": lambda: f"/tracks/bench?page={-(-n // 100)}",
        "run page": lambda: f"/runs/{rng.choice(ids)}",
        "runs JSON API": lambda: "/api/tracks/bench/runs",
        "badge": lambda: f"/runs/{rng.choice(ids)}/badge.svg",
    }
    out = {}
    try:
        with httpx.Client(base_url=url) as c:
            for name, path in pages.items():
                times = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    r = c.get(path())
                    times.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200, (path, r.status_code)
                times.sort()
                out[name] = {"p50_ms": round(statistics.median(times), 2),
                             "p95_ms": round(times[int(0.95 * len(times)) - 1], 2)}
    finally:
        server.should_exit = True
        thread.join()
        lb.engine.dispose()
    return out


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--tiny-runs", type=int, default=8)
    ap.add_argument("--gpt-runs", type=int, default=2)
    ap.add_argument("--runs-in-db", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pg", help="also measure latency on this PostgreSQL database (its tables are replaced)")
    args = ap.parse_args()
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        figures["latency_sqlite"] = latency(tmp, f"sqlite:///{tmp / 'lat.db'}", args.runs_in_db, args.requests)
        if args.pg:
            from sqlalchemy import create_engine, text

            with create_engine(args.pg).begin() as conn:
                conn.execute(text("DROP SCHEMA public CASCADE"))
                conn.execute(text("CREATE SCHEMA public"))
            figures["latency_postgresql"] = latency(tmp, args.pg, args.runs_in_db, args.requests)
        figures["throughput"] = throughput(tmp, {"tiny-mlp": args.tiny_runs, "tinygpt-100": args.gpt_runs})
    figures["runs_in_db"] = args.runs_in_db
    report(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
