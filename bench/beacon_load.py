"""The beacon under load: concurrent runs streaming heads, the latency of each stamp.

Starts ``witness beacon serve`` in a process of its own on a database (PostgreSQL by default: the
test server of ``scripts/services.sh``; ``--db sqlite`` for a file), builds every request first
(each run's manifest, its signed heads and their consistency proofs, so the load generator spends
its time on the wire), then ``--runs`` runs each stream ``--heads`` heads in their own thread, a
head every ``--every`` seconds (the pace of a training run that streams a head every few steps; 0:
as fast as the beacon answers; each run starts at a random moment of the first interval, as runs
do, not in lockstep). Prints p50, p95 and p99 of the stamp latency, the statements a
second, and the errors (anything but a 200).

    python bench/beacon_load.py [--runs 50] [--heads 40] [--every 0.25] [--db URL|sqlite] [--workers 2]
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import parser, report

from witness.commit.beacon import run_id
from witness.commit.log import RunLog
from witness.commit.signing import generate_key, public_hex

PG = os.environ.get("WITNESS_TEST_PG_URL", "postgresql+psycopg://witness:witness@127.0.0.1:5432/witness_test")
RECORDS_PER_HEAD = 10  # a head every 10 steps (OnlineSpec's default)


def bodies(heads: int) -> list[dict]:
    """One run's requests: the first head with its manifest, then heads that extend it."""
    key = generate_key()
    log = RunLog()
    log.append({"type": "manifest", "public_key": public_hex(key.public_key()), "run_seed": os.urandom(32).hex(),
                "task": "tiny", "task_config": {"steps": heads * RECORDS_PER_HEAD}})
    out, sent = [], 0
    for i in range(heads):
        for _ in range(RECORDS_PER_HEAD if i else 0):
            log.append({"type": "step", "step": len(log.lines) - 1, "loss": 1.0})
        head = log.sign_head(key)
        size = len(log.lines)
        body: dict = {"tree_head": head.to_json()}
        if i == 0:
            body["manifest"] = log.lines[0].decode()
            body["consistency"] = []
        else:
            body["consistency"] = [h.hex() for h in log.tree.consistency_proof(sent, size)]
        out.append(body)
        sent = size
    name = run_id(log.lines[0]).hex()
    for b in out[1:]:
        b["run"] = name
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_pg(url: str) -> None:
    """An empty schema (the beacon creates its tables)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


def main() -> None:
    """Run the load and report its latencies."""
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between a run's heads (0: closed loop)")
    ap.add_argument("--db", default=PG, help="a database URL, or 'sqlite' for a file")
    ap.add_argument("--workers", type=int, default=None, help="the server's worker processes (its default)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="beacon-load-"))
    db = f"sqlite:///{tmp / 'beacon.db'}" if args.db == "sqlite" else args.db
    if db.startswith("postgresql"):
        fresh_pg(db)
    port = free_port()
    cmd = [sys.executable, "-m", "witness.cli", "beacon", "serve", "--db", db, "--port", str(port),
           "--key", str(tmp / "key.pem"), "--per-minute", "1000000"]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/api/beacon/key", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the beacon did not start: {server.stderr.read()}")
            time.sleep(0.2)
        runs = [bodies(args.heads) for _ in range(args.runs)]
        latencies: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()
        go = threading.Barrier(args.runs)

        def stream(requests: list[dict], phase: float) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                go.wait()
                time.sleep(phase)  # runs started at their own moments, not in lockstep
                for body in requests:
                    started = time.perf_counter()
                    try:
                        r = http.post("/api/beacon/heads", json=body)
                        code = r.status_code
                    except httpx.HTTPError as e:
                        code = type(e).__name__
                    took = time.perf_counter() - started
                    with lock:
                        latencies.append(took)
                        if code != 200:
                            errors.append(str(code))
                    if args.every:
                        time.sleep(max(args.every - took, 0.0))

        rng = random.Random(0)
        threads = [threading.Thread(target=stream, args=(r, rng.uniform(0, args.every))) for r in runs]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
    finally:
        server.terminate()
        server.wait(30)
    q = statistics.quantiles(latencies, n=100)
    report({"db": db.split("://")[0], "runs": args.runs, "heads_per_run": args.heads, "every_s": args.every,
            "requests": len(latencies), "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
            "statements_per_s": round(len(latencies) / wall, 1), "p50_ms": round(1000 * q[49], 1),
            "p95_ms": round(1000 * q[94], 1), "p99_ms": round(1000 * q[98], 1),
            "max_ms": round(1000 * max(latencies), 1)}, args.json)


if __name__ == "__main__":
    main()
