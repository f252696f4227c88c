"""Flooding the re-challenge queue, on a live server (real concurrent requests) over SQLite and
PostgreSQL: Sybil registrations, a parallel burst from one account, and the bound on the
challenges that may wait on one run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lbhelpers import make_settings, register, submit, train_and_certify
from sqlalchemy import func, select

from witness.commit.signing import generate_key, public_hex
from witness.leaderboard.db import Job
from witness.leaderboard.demo import start_server
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.worker import work


def _queued(lb: Leaderboard) -> tuple[int, int]:
    """(re-challenge jobs, challenges) in the queue."""
    with lb.Session() as s:
        row = s.execute(select(func.count(), func.coalesce(func.sum(Job.count), 0))
                        .where(Job.kind == "rechallenge")).one()
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_sybils_and_bursts_queue_a_bounded_amount_of_work(backend, tmp_path):
    lb = Leaderboard(make_settings(backend, tmp_path, registrations_per_hour=5, rechallenges_per_hour=20,
                                   max_queued_challenges=1000))
    server, thread, url = start_server(lb, port=0)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            alice = register(c, "alice")
            run_id, bundle, cert = train_and_certify(c, alice, tmp_path / "run")
            submit(c, alice, bundle, cert)
            assert work(lb, once=True) == 1

            # Sybil registrations from one address, all at once: exactly the limit gets through
            def reg(i: int) -> int:
                with httpx.Client(base_url=url, timeout=60) as ci:
                    return ci.post("/api/accounts", json={"name": f"sybil{i}",
                                                          "public_key": public_hex(generate_key().public_key())}).status_code
            with ThreadPoolExecutor(16) as pool:
                codes = list(pool.map(reg, range(30)))
            assert sorted(set(codes)) == [201, 429] and codes.count(201) == 4, codes  # alice used one of 5
            r = c.post("/api/accounts", json={"name": "late", "public_key": public_hex(generate_key().public_key())})
            assert r.status_code == 429 and "registration limit" in r.json()["detail"]

            # a burst of 60 parallel requests from one account: exactly its hourly 20 are queued
            def ask(count: int) -> int:
                with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {alice.token}"}) as ci:
                    return ci.post(f"/api/runs/{run_id}/challenges", json={"count": count}).status_code
            with ThreadPoolExecutor(16) as pool:
                codes = list(pool.map(ask, [10] * 60))
            assert codes.count(202) == 20 and codes.count(429) == 40, codes
            assert _queued(lb) == (20, 200)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_no_number_of_accounts_queues_more_than_the_run_bound(backend, tmp_path):
    lb = Leaderboard(make_settings(backend, tmp_path, registrations_per_hour=10, max_queued_challenges=1000))
    server, thread, url = start_server(lb, port=0)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            people = [register(c, f"p{i}") for i in range(6)]
            run_id, bundle, cert = train_and_certify(c, people[0], tmp_path / "run")
            submit(c, people[0], bundle, cert)
            assert work(lb, once=True) == 1

            def ask(token: str) -> int:
                with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as ci:
                    return ci.post(f"/api/runs/{run_id}/challenges", json={"count": 500}).status_code
            # five accounts, each within its own rate limit, 20 requests of 500: 50,000 unbounded
            with ThreadPoolExecutor(16) as pool:
                codes = list(pool.map(ask, [p.token for p in people[1:] for _ in range(20)]))
            assert codes.count(202) == 2, codes
            assert _queued(lb) == (2, 1000)
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {people[1].token}"}) as ci:
                r = ci.post(f"/api/runs/{run_id}/challenges", json={"count": 1})
            assert r.status_code == 429 and "at most 1000 may wait" in r.json()["detail"]
            # once the queue is worked off, re-challenges are taken again
            assert work(lb, once=True) == 2
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {people[1].token}"}) as ci:
                assert ci.post(f"/api/runs/{run_id}/challenges", json={"count": 1}).status_code == 202
    finally:
        server.should_exit = True
        thread.join(10)
