"""The leaderboard's API, on SQLite and on a real PostgreSQL server: every write attacked."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import time

import pytest
from fastapi.testclient import TestClient
from helpers import resign_certificate
from lbhelpers import Authed, make_settings, register, submit, train_and_certify
from sqlalchemy import select

from witness.commit.hashing import canonical_json, leaf_hash
from witness.commit.signing import SignedTreeHead, generate_key
from witness.evals.certificate import results_root
from witness.leaderboard import client as C
from witness.leaderboard.app import create_app
from witness.leaderboard.db import Account, Job, Round, Run
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.worker import work
from witness.task import build_task
from witness.verify.challenges import detection_probability, draw_challenges

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def server(request, tmp_path):
    """A fresh leaderboard (quick track: tiny, 20 steps) and a test client."""
    lb = Leaderboard(make_settings(request.param, tmp_path))
    with TestClient(create_app(lb=lb)) as tc:
        yield lb, tc
    lb.engine.dispose()


def _run(lb, run_id) -> Run:
    with lb.Session() as s:
        return s.get(Run, run_id)


def test_honest_run_is_certified_with_its_evidence(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    heads = tc.get(f"/api/runs/{run_id}/heads").json()
    assert [h["size"] for h in heads] == [1, 6, 11, 16, 21, 22]  # manifest, 4 checkpoints, end record
    # a page at a time: after a size, at most a limit
    assert [h["size"] for h in tc.get(f"/api/runs/{run_id}/heads?after=6&limit=2").json()] == [11, 16]
    assert tc.get(f"/api/runs/{run_id}/heads?limit=1001").status_code == 400
    assert all(h["received_ms"] >= _run(lb, run_id).ticket_ms for h in heads)
    out = submit(tc, alice, bundle, cert)
    assert out == {"run_id": run_id, "status": "pending", "url": f"/runs/{run_id}"}
    assert work(lb, once=True) == 1
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified", r["reason"]
    q = lb.settings.certify_challenges
    assert r["challenges_passed"] == 20 and r["verdict"]["challenges"] == 20  # q = 90 > 20 steps: all replayed
    assert r["bound"] == 1.0 and q == 90  # every step was replayed
    rounds = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert len(rounds) == 1 and tc.get(f"/api/runs/{run_id}/challenges?offset=1").json() == []
    assert tc.get(f"/api/runs/{run_id}/challenges?limit=101").status_code == 400
    assert r["metric"] == "accuracy" and r["metric_value"] == r["aggregates"]["accuracy"]
    assert r["contamination"].startswith("clean: all 256 evaluation documents")
    hist = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert len(hist) == 1 and hist[0]["kind"] == "certify" and hist[0]["passed"]
    assert sorted(c["step"] for c in hist[0]["challenges"]) == list(range(20))
    # downloads: the archive exactly as uploaded, the certificate, the verdict
    tar = tc.get(f"/runs/{run_id}/download/submission.tar")
    assert hashlib.sha256(tar.content).hexdigest() == r["bundle_sha256"]
    assert json.loads(tc.get(f"/runs/{run_id}/download/evaluation.json").content)["aggregates"]["accuracy"] == r["metric_value"]
    assert tc.get(f"/runs/{run_id}/download/verdict.json").json()["accepted"] is True
    page = tc.get(f"/runs/{run_id}")
    assert page.status_code == 200 and "certified" in page.text and "/plots/loss.svg" in page.text
    assert tc.get(f"/runs/{run_id}/plots/loss.svg").headers["content-type"] == "image/svg+xml"
    assert "certified" in tc.get(f"/runs/{run_id}/badge.svg").text
    assert f'href="/runs/{run_id}"' in tc.get("/tracks/quick").text


def test_tokens_are_needed_and_stored_only_as_hashes(server):
    lb, tc = server
    alice = register(tc, "alice")
    assert tc.post("/api/tickets", json={"track": "quick"}).status_code == 401
    assert tc.post("/api/tickets", json={"track": "quick"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert tc.post("/api/runs/1/challenges", json={"count": 1}).status_code == 401
    assert tc.post("/api/submissions", content=b"x").status_code == 401
    with lb.Session() as s:
        acct = s.scalar(select(Account).where(Account.name == "alice"))
        assert acct.token_hash == hashlib.sha256(alice.token.encode()).hexdigest() != alice.token
    # a name or key cannot be registered twice; names are plain
    assert tc.post("/api/accounts", json={"name": "alice", "public_key": "00" * 32}).status_code in (400, 409)
    assert tc.post("/api/accounts", json={"name": "<script>", "public_key": "11" * 32}).status_code == 400
    assert tc.post("/api/accounts", json={"name": "x", "public_key": "zz"}).status_code == 400


def test_only_registered_tracks_and_their_exact_recipe(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    api = Authed(tc, alice.token)
    r = api.post("/api/tickets", json={"track": "other"})
    assert r.status_code == 404 and "no track" in r.json()["detail"]
    # a run of the right task with another recipe is refused at its first head
    tk = C.ticket(api, "quick")
    from witness.record import Commitments, Online, Recorder

    task = build_task("tiny", {"steps": 21})
    with pytest.raises(C.LeaderboardError, match="recipe is not track 'quick'"):
        Recorder.create(task, tmp_path / "b", alice.key, r=bytes.fromhex(tk["r"]),
                        commit=Commitments(r_source="ticket"), online=Online(on_head=C.HeadStreamer(api, tk["run_id"])))


def test_a_submission_signed_with_another_key_is_refused(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    # heads signed by a key that is not the account's are refused while training...
    with pytest.raises(C.LeaderboardError, match="signature on the tree head"):
        train_and_certify(tc, alice, tmp_path / "a", key=generate_key())
    # ...and a bundle signed by another key is refused at upload
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "b", key=generate_key(), stream=False)
    with pytest.raises(C.LeaderboardError, match="400: .*signed by another key"):
        submit(tc, alice, bundle, cert)
    # mallory cannot submit alice's run, even signed by alice's key
    mallory = register(tc, "mallory")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "c")
    with pytest.raises(C.LeaderboardError, match="400: .*signed by another key"):
        submit(tc, mallory, bundle, cert)
    assert _run(lb, run_id).status == "ticketed"


def test_a_bundle_that_does_not_extend_the_streamed_heads_is_rejected(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "streamed")
    # the trainer writes another log for the same ticket after the fact (its checkpoints differ)
    from witness.record import Commitments, Recorder

    tk_r = _run(lb, run_id).r
    rewritten = tmp_path / "rewritten"
    task = build_task("tiny", {"steps": 20})
    rec = Recorder.create(task, rewritten, alice.key, r=bytes.fromhex(tk_r),
                          commit=Commitments(checkpoint_every=4, r_source="ticket"))
    rec.train(progress=False)
    with pytest.raises(C.LeaderboardError, match="rejected: the submitted log does not extend the tree head of size 1"):
        submit(tc, alice, rewritten, cert)
    run = _run(lb, run_id)
    assert run.status == "rejected" and "rewritten after that head was published" in run.reason
    # and the honest bundle cannot be slipped in afterwards
    with pytest.raises(C.LeaderboardError, match="409"):
        submit(tc, alice, bundle, cert)
    # nor can heads be streamed to a closed log
    assert Authed(tc, alice.token).post(f"/api/runs/{run_id}/heads", json={"tree_head": {}}).status_code == 409


def test_streamed_heads_must_be_consistent(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    api = Authed(tc, alice.token)
    tk = C.ticket(api, "quick")
    from witness.record import Commitments, Online, Recorder

    seen = []
    rec = Recorder.create(build_task("tiny", {"steps": 20}), tmp_path / "b", alice.key, r=bytes.fromhex(tk["r"]),
                          commit=Commitments(checkpoint_every=5, r_source="ticket"),
                          online=Online(on_head=lambda h, log: seen.append((h, list(log.lines)))))
    rec.train(progress=False)
    first, lines1 = seen[0]
    ok = api.post(f"/api/runs/{tk['run_id']}/heads", json={"tree_head": first.to_json(), "manifest": lines1[0].decode()})
    assert ok.status_code == 201
    h2, _ = seen[2]
    # no proof, a wrong proof, a bad signature: refused
    r = api.post(f"/api/runs/{tk['run_id']}/heads", json={"tree_head": h2.to_json(), "consistency": []})
    assert r.status_code == 400 and "does not extend" in r.json()["detail"]
    r = api.post(f"/api/runs/{tk['run_id']}/heads", json={"tree_head": h2.to_json(), "consistency": ["00" * 32] * 3})
    assert r.status_code == 400
    forged = dict(h2.to_json(), root="ab" * 32)
    r = api.post(f"/api/runs/{tk['run_id']}/heads", json={"tree_head": forged, "consistency": []})
    assert r.status_code == 400 and "signature" in r.json()["detail"]
    assert [h["size"] for h in tc.get(f"/api/runs/{tk['run_id']}/heads").json()] == [1]


def test_a_forged_evaluation_claim_is_rejected(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    run_id, bundle, cert_path = train_and_certify(tc, alice, tmp_path / "run")
    cert = json.loads(cert_path.read_bytes())
    # claim every example correct: consistent on its face (root and aggregates recomputed, re-signed)
    examples = [dict(e, correct=True) for e in cert["results"]["examples"]]
    results = {"root": results_root(examples).hex(), "count": len(examples), "examples": examples}
    forged = resign_certificate(dict(cert, results=results, aggregates=build_task("tiny").aggregates(examples)), alice.key)
    cert_path.write_bytes(canonical_json(forged))
    submit(tc, alice, bundle, cert_path)
    work(lb, once=True)
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "rejected" and "evaluation certificate" in r["reason"] and "spot check" in r["reason"]
    assert r["metric_value"] is None
    assert "rejected" in tc.get(f"/runs/{run_id}").text


def test_oversized_and_malformed_uploads(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    api = Authed(tc, alice.token)
    lb.settings.max_upload = 20_000
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    with pytest.raises(C.LeaderboardError, match="413: the upload is over the server's limit of 20000 bytes"):
        submit(tc, alice, bundle, cert)
    # a chunked upload that never declares its length is cut off while streaming
    r = api.post("/api/submissions", content=iter([b"\0" * 8192] * 4), headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 413
    assert not list((lb.store.root / "incoming").iterdir())  # nothing left behind
    r = api.post("/api/submissions", content=b"not a tar archive at all")
    assert r.status_code == 400 and "not a tar archive" in r.json()["detail"]
    assert _run(lb, run_id).status == "ticketed"
    # JSON bodies are bounded too
    r = api.post("/api/tickets", content=b"{" + b" " * (2 << 20) + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.mark.parametrize("members, message", [
    ([_file("bundle/../../escape.txt")], "escapes the upload"),
    ([_file("../escape.txt")], "escapes the upload"),
    ([_file("/tmp/escape.txt")], "escapes the upload"),
    ([_file("bundle/ok"), _link("bundle/link", "/etc/passwd")], "link or special file"),
    ([_link("bundle/hard", "/etc/passwd", tarfile.LNKTYPE)], "link or special file"),
    ([_file("elsewhere.txt")], "neither under bundle/"),
    ([_file("bundle/a"), _file("bundle/a")], "names a file twice"),
    ([_file("evaluation.json")], "no bundle/ folder"),
    ([_file("bundle/bundle.json", b"{}"), _file("evaluation.json")], "the bundle has no log.jsonl"),
])
def test_path_traversal_and_odd_archives_are_refused(server, tmp_path, members, message):
    lb, tc = server
    alice = register(tc, "alice")
    r = Authed(tc, alice.token).post("/api/submissions", content=_tar(members))
    assert r.status_code == 400 and message in r.json()["detail"], r.text
    assert str(lb.store.root.name) not in r.text and str(tmp_path) not in r.text  # no server path is shown
    assert not (lb.store.root.parent / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()
    assert not list((lb.store.root / "incoming").iterdir())


def test_a_compressed_submission_is_unpacked_as_it_arrives_and_a_compression_bomb_is_refused(server, tmp_path):
    import gzip

    from witness.store import pack

    lb, tc = server
    alice = register(tc, "alice")
    api = Authed(tc, alice.token)
    lb.settings.max_upload = 1 << 20
    bomb = gzip.compress(_tar([_file("bundle/zeros", bytes(8 << 20))]))  # 8 MB of zeros in a few KB
    assert len(bomb) < 64 << 10
    r = api.post("/api/submissions", content=bomb)
    assert r.status_code == 400 and "unpacks to more than the server's limit of 4194304 bytes" in r.json()["detail"]
    assert not list((lb.store.root / "incoming").iterdir())
    lb.settings.max_upload = 64 << 20
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    archive = pack(bundle, tmp_path / "submission.tar", cert)
    r = api.post("/api/submissions", content=gzip.compress(archive.read_bytes()), params={"r": _run(lb, run_id).r})
    assert r.status_code == 202 and r.json()["run_id"] == run_id, r.text
    assert (lb.store.local_bundle_root(run_id) / "bundle" / "log.jsonl").read_bytes() == (bundle / "log.jsonl").read_bytes()


def test_rechallenges_are_rate_limited(server, tmp_path):
    lb, tc = server
    lb.settings.rechallenges_per_hour = 2
    alice, bob = register(tc, "alice"), register(tc, "bob")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    bob_api = Authed(tc, bob.token)
    assert bob_api.post(f"/api/runs/{run_id}/challenges", json={"count": 3}).status_code == 409  # not certified yet
    submit(tc, alice, bundle, cert)
    work(lb, once=True)
    assert bob_api.post(f"/api/runs/{run_id}/challenges", json={"count": 0}).status_code == 400
    assert bob_api.post(f"/api/runs/{run_id}/challenges", json={"count": 10**6}).status_code == 400
    for _ in range(2):
        assert bob_api.post(f"/api/runs/{run_id}/challenges", json={"count": 3}).status_code == 202
    r = bob_api.post(f"/api/runs/{run_id}/challenges", json={"count": 3})
    assert r.status_code == 429 and "rate limit" in r.json()["detail"]
    # the limit is per account: alice may still ask
    assert Authed(tc, alice.token).post(f"/api/runs/{run_id}/challenges", json={"count": 3}).status_code == 202
    assert work(lb, once=True) == 3
    hist = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert [(h["kind"], h["requested_by"], h["passed"]) for h in hist] == \
        [("certify", "server", True), ("rechallenge", "bob", True), ("rechallenge", "bob", True), ("rechallenge", "alice", True)]
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified" and r["challenges_passed"] == 29 and r["bound"] == 1.0


def test_a_failed_rechallenge_revokes_the_certificate(server, tmp_path):
    lb, tc = server
    lb.settings.confidence, lb.settings.bad_fraction = 0.04, 0.05  # one challenge at submission
    assert lb.settings.certify_challenges == 1
    alice, bob = register(tc, "alice"), register(tc, "bob")
    # alice trains step 12 with a secret learning rate: replaying anything in [10, 15) shows it
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run", lr_cheat={12: 3.0})
    from witness.bundle.reader import open_bundle

    head = open_bundle(bundle).final_head
    # the server's draw happens to miss the bad interval (found by trying nonces, then fixed)
    nonce = next(n.to_bytes(16, "big") for n in range(1000)
                 if not 10 <= draw_challenges(head, n.to_bytes(16, "big"), 20, 1)[0].step < 15)
    lb.randomness = lambda k: nonce[:k] if k == 16 else bytes(k)
    submit(tc, alice, bundle, cert)
    work(lb, once=True)
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified" and r["bound"] == pytest.approx(detection_probability(0.05, 1))
    lb.randomness = __import__("os").urandom
    job = Authed(tc, bob.token).post(f"/api/runs/{run_id}/challenges", json={"count": 20}).json()
    work(lb, once=True)
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "revoked" and "re-challenge" in r["reason"] and "step 12: replay" in r["reason"]
    hist = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert hist[-1]["job_id"] == job["job_id"] and not hist[-1]["passed"] and hist[-1]["requested_by"] == "bob"
    assert any(not c["passed"] for c in hist[-1]["challenges"])
    page = tc.get(f"/runs/{run_id}").text
    assert "revoked" in page and "Revoked" in page
    assert "revoked" in tc.get(f"/runs/{run_id}/badge.svg").text
    # a revoked run takes no more challenges
    assert Authed(tc, bob.token).post(f"/api/runs/{run_id}/challenges", json={"count": 1}).status_code == 409


def test_pages_escape_html_and_filter(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    with lb.Session() as s:
        s.get(Run, run_id).reason = '<script>alert("x")</script>'
        s.commit()
    page = tc.get(f"/runs/{run_id}").text
    assert "<script>" not in page and "&lt;script&gt;" in page
    with lb.Session() as s:  # a run with some optional fields and not others still renders
        r = s.get(Run, run_id)
        r.status, r.aggregates_json = "certified", '{"accuracy": 0.5}'
        s.commit()
    assert tc.get(f"/runs/{run_id}").status_code == 200
    with lb.Session() as s:
        s.get(Run, run_id).status = "ticketed"
        s.commit()
    assert "default-src 'none'" in tc.get(f"/runs/{run_id}").headers["content-security-policy"]
    assert tc.get("/tracks/quick?sort=evil").status_code == 400
    assert tc.get("/tracks/quick?since=yesterday").status_code == 400
    for far in ("/tracks/quick?until=9999-12-31", "/api/tracks/quick/runs?until=9999-12-31&since=0001-01-01"):
        assert tc.get(far).status_code == 200, far  # the last date there is: no bound (it overflowed once)
    # the ticketed run is in progress, not in the ranking (which holds certified runs only)
    page = tc.get("/tracks/quick").text
    assert page.count('class="run"') == 1 and 'id="waiting"' in page and "No certified run yet" in page
    assert f'data-status="ticketed"><td><a href="/runs/{run_id}">' in page
    assert tc.get("/tracks/%3Cb%3E").status_code == 404 and "<b>" not in tc.get("/tracks/%3Cb%3E").text
    api = tc.get("/openapi.json").json()
    assert {"/api/submissions", "/api/tickets", "/api/runs/{run_id}/heads", "/api/runs/{run_id}/challenges"} <= set(api["paths"])


def test_queue_claims_each_job_once(server, tmp_path):
    from witness.leaderboard import queue

    lb, tc = server
    alice = register(tc, "alice")
    run_id, _, _ = train_and_certify(tc, alice, tmp_path / "run")
    with lb.Session() as s:
        ids = [queue.enqueue(s, run_id, "rechallenge", 1).id for _ in range(3)]
        s.commit()
    with lb.Session() as a, lb.Session() as b:
        j1 = queue.claim(a, "w1")
        j2 = queue.claim(b, "w2")
        assert {j1.id, j2.id} == set(ids[:2])
        j3 = queue.claim(a, "w1")
        assert j3.id == ids[2] and queue.claim(b, "w2") is None
        # a worker that died: its lease expires and the job is queued again, not lost
        assert queue.requeue_expired(a, lease_ms=-1) == 3
        assert queue.claim(b, "w2").attempts == 2
    with lb.Session() as s:
        assert s.scalar(select(Job).where(Job.id == ids[0])).worker == "w2"
        assert s.scalars(select(Round)).all() == []


def test_the_migrations_build_exactly_the_models_schema(server):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import MetaData

    from witness.beacon.db import BeaconBase
    from witness.beacon.operator_db import OperatorBase
    from witness.beacon.witness_db import WitnessBase
    from witness.leaderboard.db import Base, migrate

    lb, _ = server
    migrate(lb.engine)  # idempotent
    models = MetaData()  # the leaderboard's own tables and the beacon's (its witness's, its operator log's) it mounts
    for table in (*Base.metadata.tables.values(), *BeaconBase.metadata.tables.values(),
                  *WitnessBase.metadata.tables.values(), *OperatorBase.metadata.tables.values()):
        table.to_metadata(models)
    with lb.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), models) == []
        assert MigrationContext.configure(conn).get_current_revision() == "0012"


def test_a_weakly_anchored_run_is_rejected(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    lb.settings.max_head_gap = 8
    # checkpoints (and so streamed heads) every 10 steps leave 10 records unanchored in a row
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "sparse", checkpoint_every=10)
    with pytest.raises(C.LeaderboardError, match="weakly time-anchored: .*10 records unanchored"):
        submit(tc, alice, bundle, cert)
    assert _run(lb, run_id).status == "rejected"
    # a final head kept back until after the upload does not anchor the end of the log
    lb.settings.max_head_gap = 200
    api = Authed(tc, alice.token)
    tk = C.ticket(api, "quick")
    from witness.record import Commitments, Online, Recorder

    streamer = C.HeadStreamer(api, tk["run_id"])
    rec = Recorder.create(build_task("tiny", {"steps": 20}), tmp_path / "late", alice.key, r=bytes.fromhex(tk["r"]),
                          commit=Commitments(checkpoint_every=5, r_source="ticket"),
                          online=Online(on_head=lambda h, log: streamer(h, log) if h.extensions is None else None))
    rec.train(progress=False)
    with pytest.raises(C.LeaderboardError, match="final tree head \\(size 22\\) was not streamed"):
        submit(tc, alice, tmp_path / "late", cert)


def test_a_long_verification_keeps_its_lease(server, tmp_path, monkeypatch):
    # A worker renews its lease while it verifies, so a job that outlasts the lease is neither
    # taken up again by a second worker nor verified twice.
    from witness.leaderboard import worker as W

    lb, tc = server
    alice = register(tc, "alice")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    submit(tc, alice, bundle, cert)
    real, started = W.verify_round, threading.Event()

    def slow(*a, **kw):
        started.set()
        time.sleep(2.0)  # four lease periods of 0.5 s
        return real(*a, **kw)

    monkeypatch.setattr(W, "verify_round", slow)
    first = threading.Thread(target=W.work, args=(lb,), kwargs={"worker": "w1", "once": True, "lease_ms": 500})
    first.start()
    assert started.wait(60)
    time.sleep(1.0)  # the lease, unrenewed, would have expired twice by now
    assert W.work(lb, worker="w2", once=True, lease_ms=500) == 0  # nothing to take up
    first.join(120)
    with lb.Session() as s:
        jobs = s.scalars(select(Job).where(Job.run_id == run_id)).all()
        assert [(j.status, j.worker, j.attempts) for j in jobs] == [("done", "w1", 1)]
        assert len(s.scalars(select(Round).where(Round.run_id == run_id)).all()) == 1
    assert _run(lb, run_id).status == "certified"


def test_absurd_numbers_and_odd_bodies_get_a_4xx(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    api = Authed(tc, alice.token)
    for path in ("/runs/99999999999999999999999", "/api/runs/99999999999999999999999",
                 "/api/runs/99999999999999999999999/challenges", "/runs/2147483648/badge.svg"):
        r = tc.get(path)  # an id no table holds: a 400 that names it, before the database is asked
        assert r.status_code == 400 and "run_id" in r.json()["detail"], path
    for path in ("/tracks/quick?page=99999999999999999999", "/api/tracks/quick/runs?page=9223372036854775807",
                 "/api/tracks/quick/runs?page=0"):
        r = tc.get(path)
        assert 400 <= r.status_code < 500, (path, r.status_code)
    r = api.post("/api/runs/99999999999999999999999/challenges", json={"count": 1})
    assert r.status_code == 400
    # counts are JSON integers, not strings or booleans that a lax parser would coerce
    for bad in ("5", True, 5.0):
        r = api.post("/api/runs/1/challenges", json={"count": bad})
        assert r.status_code == 400 and "count" in r.json()["detail"], (bad, r.text)
    assert tc.post("/api/accounts", json={"name": "bob", "public_key": "11" * 32, "admin": True}).status_code == 400
    # a first head whose manifest is the signed leaf but not canonical JSON
    tk = C.ticket(api, "quick")
    manifest = '{"type": "manifest",  "r": "00"}'
    head = SignedTreeHead.sign(alice.key, 1, leaf_hash(manifest.encode()))
    r = api.post(f"/api/runs/{tk['run_id']}/heads", json={"tree_head": head.to_json(), "manifest": manifest})
    assert r.status_code == 400 and "canonical" in r.json()["detail"], r.text


def test_refusals_name_files_inside_the_upload_not_the_server_store(tmp_path):
    from witness.leaderboard.service import _hide

    staging = tmp_path / "store" / "incoming" / "abc"
    e = ValueError(f"{staging}/evaluation.json is not a certificate; {staging} is odd")
    assert _hide(e, staging) == "evaluation.json is not a certificate; the upload is odd"


def test_a_worker_that_can_no_longer_replay_a_run_does_not_revoke_it(server, tmp_path, monkeypatch):
    # The server upgraded torch (or a worker on other hardware joined): a re-challenge cannot
    # replay the certified run exactly. That is the server's problem, never the trainer's: the
    # job fails with the reason, and the run keeps its certificate and takes challenges later.
    from witness.leaderboard.db import Job
    from witness.verify import audit

    lb, tc = server
    alice, bob = register(tc, "alice"), register(tc, "bob")
    run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
    submit(tc, alice, bundle, cert)
    work(lb, once=True)
    assert tc.get(f"/api/runs/{run_id}").json()["status"] == "certified"
    monkeypatch.setattr(audit, "torch_version", lambda: "9.9.9")
    job = Authed(tc, bob.token).post(f"/api/runs/{run_id}/challenges", json={"count": 2}).json()
    assert work(lb, once=True) == 1
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified" and not r["reason"], r
    with lb.Session() as s:
        failed = s.get(Job, job["job_id"])
        assert failed.status == "failed" and "cannot replay" in failed.error and "torch" in failed.error
    assert [h["kind"] for h in tc.get(f"/api/runs/{run_id}/challenges").json()] == ["certify"]  # no failed round
    monkeypatch.undo()  # back on a machine that replays it: challenges go on as before
    Authed(tc, bob.token).post(f"/api/runs/{run_id}/challenges", json={"count": 2})
    work(lb, once=True)
    hist = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert [h["kind"] for h in hist] == ["certify", "rechallenge"] and hist[-1]["passed"]
