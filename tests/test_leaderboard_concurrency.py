"""12 submissions from parallel clients and two worker processes: nothing lost, nothing verified twice."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lbhelpers import QUICK, make_settings, register, submit, train_and_certify
from sqlalchemy import func, select

from witness.leaderboard import client as C
from witness.leaderboard.db import Job, Round, Run
from witness.leaderboard.demo import start_server
from witness.leaderboard.service import Leaderboard

RUNS = 12
CHEATERS = {3, 8}


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_parallel_submissions_and_two_workers(backend, tmp_path):
    settings = make_settings(backend, tmp_path, registrations_per_hour=RUNS)  # 12 trainers behind one address
    lb = Leaderboard(settings)
    server, thread, url = start_server(lb, port=0)
    workers = [subprocess.Popen(
        [sys.executable, "-m", "witness.cli", "leaderboard", "worker", "--db", settings.db_url,
         "--store", str(settings.store), "--track", QUICK, "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"worker{i}.log", "w")) for i in range(2)]
    try:
        def one(i: int) -> tuple[int, int]:
            with httpx.Client(base_url=url, timeout=120) as c:
                t = register(c, f"trainer{i}")
                cheat = {s: 2.0 for s in range(5, 15)} if i in CHEATERS else None
                run_id, bundle, cert = train_and_certify(c, t, tmp_path / f"run{i}", lr_cheat=cheat)
                if i == 0:  # the same run submitted twice at once: exactly one is taken
                    with ThreadPoolExecutor(2) as pool:
                        outcomes = list(pool.map(lambda _: _try(c, t, bundle, cert), range(2)))
                    assert sorted(outcomes) == [202, 409], outcomes
                else:
                    submit(c, t, bundle, cert)
                return i, run_id

        with ThreadPoolExecutor(RUNS) as pool:
            ids = dict(pool.map(one, range(RUNS)))
        deadline = time.monotonic() + 600
        while True:
            with lb.Session() as s:
                open_ = s.scalar(select(func.count()).select_from(Run).where(Run.status.in_(["pending", "verifying"])))
            if not open_ or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        with lb.Session() as s:
            runs = {r.id: r for r in s.scalars(select(Run))}
            jobs = list(s.scalars(select(Job)))
            rounds = list(s.scalars(select(Round)))
        assert len(runs) == RUNS
        for i, run_id in ids.items():
            expected = "rejected" if i in CHEATERS else "certified"
            assert runs[run_id].status == expected, (i, runs[run_id].status, runs[run_id].reason)
        assert len(jobs) == RUNS and all(j.status == "done" and j.attempts == 1 for j in jobs)
        assert sorted(r.job_id for r in rounds) == sorted(j.id for j in jobs)  # one round per job: none twice
        assert len({j.worker for j in jobs}) == 2, "both workers took jobs"
        assert {j.run_id for j in jobs} == set(ids.values())
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
        server.should_exit = True
        thread.join(30)
        lb.engine.dispose()


def _try(c: httpx.Client, t, bundle, cert) -> int:
    try:
        submit(c, t, bundle, cert)
        return 202
    except C.LeaderboardError as e:
        return int(str(e).split(":")[0])
