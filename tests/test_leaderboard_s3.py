"""The leaderboard on an S3-compatible object store (a real one: SeaweedFS's S3 gateway, which
scripts/services.sh starts on loopback), with a worker in another process that shares nothing with
the server but PostgreSQL and the object store."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from lbhelpers import (
    BUCKET,
    QUICK,
    S3_ENV,
    S3_URL,
    Authed,
    fresh_postgres,
    fresh_s3,
    register,
    submit,
    tar_bytes,
    train_and_certify,
    unfinished_s3,
)

from witness.leaderboard.app import create_app
from witness.leaderboard.service import Leaderboard, Settings
from witness.leaderboard.tracks import parse_track
from witness.store import archive_key
from witness.web import start_uvicorn, stop_uvicorn


@pytest.fixture
def s3(monkeypatch):
    """A fresh prefix in the test bucket."""
    return fresh_s3(monkeypatch)


def test_the_s3_store_round_trips_a_multipart_file_and_lists_and_deletes(s3, tmp_path):
    from boto3.s3.transfer import TransferConfig

    from witness.store.s3 import S3Store

    store = S3Store(s3, tmp_path / "work")
    store.transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)  # S3's smallest part
    data = os.urandom(12 << 20)  # three parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.put("runs/7/submission.tar", src)
    assert not src.exists()  # consumed
    assert store.exists("runs/7/submission.tar") and not store.exists("runs/8/submission.tar")
    assert store.sha256("runs/7/submission.tar") == hashlib.sha256(data).hexdigest()
    got = store.fetch("runs/7/submission.tar", tmp_path / "back.bin")
    assert got.read_bytes() == data
    assert [k for k, _ in store.keys("runs/")] == ["runs/7/submission.tar"]
    store.delete("runs/7/submission.tar")
    assert not store.exists("runs/7/submission.tar") and list(store.keys("runs/")) == []
    with pytest.raises(FileNotFoundError):
        store.fetch("runs/7/submission.tar", tmp_path / "gone.bin")


def test_a_worker_elsewhere_certifies_a_run_through_postgres_and_the_object_store(s3, tmp_path):
    db = fresh_postgres()
    key = tmp_path / "server_key.pem"
    settings = Settings(db_url=db, store=s3, work=tmp_path / "server-work", tracks=(parse_track(QUICK),),
                        server_key=key, presign_endpoint=S3_URL)
    lb = Leaderboard(settings)
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
        assert submit(tc, alice, bundle, cert)["status"] == "pending"
        assert lb.store.exists(archive_key(run_id))  # the submission is an object in the bucket
        # a worker on "another machine": its own working folder, the database and the bucket only
        worker_work = tmp_path / "worker-work"
        out = subprocess.run(
            [sys.executable, "-m", "witness.cli", "leaderboard", "worker", "--db", db, "--store", s3,
             "--work", str(worker_work), "--server-key", str(key), "--track", QUICK, "--once"],
            env=os.environ | S3_ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "1 job(s) done" in out.stdout, out.stderr[-3000:]
        r = tc.get(f"/api/runs/{run_id}").json()
        assert r["status"] == "certified", r
        assert (worker_work / "cache" / str(run_id) / "bundle" / "log.jsonl").is_file()  # fetched and unpacked there
        # downloads are redirects to presigned links: the bytes come from the store, not the server

        def download(name: str) -> httpx.Response:
            redirect = tc.get(f"/runs/{run_id}/download/{name}", follow_redirects=False)
            assert redirect.status_code == 307 and redirect.headers["location"].startswith(S3_URL), redirect.text
            got = httpx.get(redirect.headers["location"], timeout=60)
            assert got.status_code == 200 and f'filename="run-{run_id}-{name}"' in got.headers["content-disposition"]
            return got

        archive = download("submission.tar")
        assert hashlib.sha256(archive.content).hexdigest() == r["bundle_sha256"]
        model = download("model.safetensors")
        assert len(model.content) > 0
        # plots come through the server (the page's own origin, as its security policy asks)
        assert tc.get(f"/runs/{run_id}/plots/loss.svg").text.startswith("<?xml")
        assert tc.get(f"/runs/{run_id}/download/verdict.json").status_code == 200
        decision = json.loads(base64.b64decode(tc.get(f"/api/runs/{run_id}/certification").json()["payload"]))
        # the signed decision names that file, by the SHA-256 the worker stored with it
        assert decision["subject"][0]["digest"]["sha256"] == hashlib.sha256(model.content).hexdigest()
    lb.engine.dispose()


def test_an_upload_goes_into_the_bucket_as_it_arrives_and_one_refused_or_cut_off_leaves_nothing(s3, tmp_path):
    lb = Leaderboard(Settings(db_url=f"sqlite:///{tmp_path / 'lb.db'}", store=s3, work=tmp_path / "work",
                              tracks=(parse_track(QUICK),), body_idle_timeout=5.0))
    lb.store.part = 5 << 20  # S3's smallest part, so that a 12 MB upload is three
    server, thread, url = start_uvicorn(create_app(lb=lb))
    try:
        token = register(httpx.Client(base_url=url), "alice").token
        data = tar_bytes({"bundle/bundle.json": b"{}", "bundle/checkpoints/pad": os.urandom(12 << 20)})
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                     + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data[: 11 << 20])
        store = lb.store
        deadline = time.monotonic() + 20
        parts: list = []
        while len(parts) < 2 and time.monotonic() < deadline:  # two parts in the bucket, the body not all sent
            ups = store.s3.list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix + "incoming/").get("Uploads", [])
            if ups:
                parts = store.s3.list_parts(Bucket=BUCKET, Key=ups[0]["Key"], UploadId=ups[0]["UploadId"]).get("Parts", [])
            time.sleep(0.05)
        assert [p["Size"] for p in parts] == [5 << 20, 5 << 20]
        # nothing of the archive itself is on the server's disk: only the bundle it unpacks to check
        assert [p.name.startswith("unpack-") for p in (tmp_path / "work" / "incoming").iterdir()] == [True]
        sock.close()  # the client goes away: the multipart upload is aborted, the unpacked part removed
        deadline = time.monotonic() + 10
        while (unfinished_s3(lb.store) or any((tmp_path / "work" / "incoming").iterdir())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert unfinished_s3(lb.store) == [] and list((tmp_path / "work" / "incoming").iterdir()) == []

        # found bad at its first member: the rest is read and stored nowhere, the answer is a clean 400
        bad = tar_bytes({"../evil": b"x", "bundle/pad": os.urandom(8 << 20)})
        r = httpx.post(f"{url}/api/submissions", content=bad, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 400 and "escapes the upload" in r.json()["detail"], r.text
        # unpacked whole and refused by the bundle check
        junk = tar_bytes({"bundle/bundle.json": b"{}", "bundle/pad": os.urandom(6 << 20)})
        r = httpx.post(f"{url}/api/submissions", content=junk, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 400 and "the bundle is not valid" in r.json()["detail"], r.text
        assert unfinished_s3(lb.store) == [] and list(store.keys("runs/")) == []
        assert list((tmp_path / "work" / "incoming").iterdir()) == []
    finally:
        stop_uvicorn(server, thread)
        lb.engine.dispose()


def test_the_scale_out_demo_is_certified_by_worker_processes_on_postgres_and_the_object_store(s3, tmp_path, capsys):
    from sqlalchemy import create_engine, text

    from witness.leaderboard.demo import run_demo

    db = fresh_postgres()
    assert run_demo(tmp_path / "demo", port=0, serve=False, db=db, store=s3, workers=2) == 0
    out = capsys.readouterr().out
    assert out.count("CERTIFIED") == 4 and out.count("REJECTED") == 2, out
    assert "90 challenges passed" in next(line for line in out.splitlines() if "by alice" in line)
    engine = create_engine(db)
    with engine.connect() as c:
        workers = {w for (w,) in c.execute(text("SELECT worker FROM jobs WHERE status = 'done'"))}
    engine.dispose()
    # every job was done by the worker processes, none by the demo's own process
    assert workers and not any(w.endswith(f":{os.getpid()}") for w in workers), workers
    assert any((tmp_path / "demo" / f"worker-{i}" / "cache").is_dir() for i in range(2))  # fetched from the bucket
    # a database and a prefix that hold a leaderboard are left alone, unless asked to empty them
    assert run_demo(tmp_path / "again", port=0, serve=False, db=db, store=s3, workers=1) == 2
    assert "holds a leaderboard already" in capsys.readouterr().err


def test_a_worker_elsewhere_audits_an_online_run_on_the_servers_statements_not_the_trainers_copy(s3, tmp_path):
    from witness.bundle.layout import STATEMENTS
    from witness.leaderboard import client as C
    from witness.leaderboard.worker import work

    every_step = "all=tiny:steps=20,online=1.0@accuracy+"  # p = 1: every step is selected
    db = fresh_postgres()
    lb = Leaderboard(Settings(db_url=db, store=s3, work=tmp_path / "server-work", tracks=(parse_track(every_step),),
                              server_key=tmp_path / "server_key.pem"))
    # a worker on another machine: its own working folder, the database and the bucket only
    elsewhere = Leaderboard(dataclasses.replace(lb.settings, work=tmp_path / "worker-work"), sync_tracks=False)
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        api = Authed(tc, alice.token)
        run_id, _ = C.train_ticketed(api, "all", alice.key, tmp_path / "run",
                                     C.TicketedRun(checkpoint_every=5, online=True))
        assert work(elsewhere, once=True) >= 1  # the selected steps, replayed while the run was open
        # the trainer keeps only its first statement: in its copy, no step after the first window was selected
        kept = tmp_path / "run" / STATEMENTS
        lines = kept.read_bytes().splitlines()
        assert len(lines) > 2
        kept.write_bytes(lines[0] + b"\n")
        C.submit(api, tmp_path / "run", C.write_evaluation(tmp_path / "run", alice.key, tmp_path / "eval.json"))
        assert work(elsewhere, once=True) == 1
        r = tc.get(f"/api/runs/{run_id}").json()
        assert r["status"] == "certified", r["reason"]
        # all 20 steps audited online, as the server's own statements selected them
        assert r["verdict"]["mode"] == "online" and r["verdict"]["challenges"] == 20, r["verdict"]
        assert (tmp_path / "worker-work" / "cache" / str(run_id) / "bundle").is_dir()  # fetched from the bucket
    lb.engine.dispose()
    elsewhere.engine.dispose()


def test_a_working_folder_keeps_unpacked_bundles_within_its_bound_least_recently_used_first(s3, tmp_path):
    from witness.store.s3 import S3Store

    store = S3Store(s3, tmp_path / "work")
    store.cache_bytes = 5 << 20  # two of these bundles, not three
    pads = {}
    for run_id in (1, 2, 3):
        pads[run_id] = os.urandom(2 << 20)
        src = tmp_path / f"{run_id}.tar"
        src.write_bytes(tar_bytes({"bundle/bundle.json": b"{}", "bundle/pad": pads[run_id]}))
        store.put(archive_key(run_id), src)

    def cached() -> list[int]:
        return sorted(int(p.name) for p in (tmp_path / "work" / "cache").iterdir() if p.name.isdigit())

    store.bundle_dir(1)
    store.bundle_dir(2)
    store.bundle_dir(1)  # used again: 2 is now the least recently used
    store.bundle_dir(3)
    assert cached() == [1, 3]
    with store.keep_bundle(1), store.keep_bundle(3):  # in use by workers of this machine: neither goes
        assert (store.bundle_dir(2) / "pad").read_bytes() == pads[2]  # fetched and unpacked again
        assert cached() == [1, 2, 3]
    store.evict()  # free again: the least recently used goes
    assert cached() == [2, 3]


def _procs_with(text: str) -> list[int]:
    """The pids of this machine's processes whose command line holds ``text``."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and int(d) != os.getpid():
                found.append(int(d))
    return found


def test_the_scale_out_demo_says_what_reset_empties(s3, tmp_path, capsys):
    from witness.leaderboard.demo import DEFAULT_TRACKS, _scaled

    db = fresh_postgres()
    tracks = tuple(DEFAULT_TRACKS[:1])
    lb = _scaled(tmp_path / "a", tracks, db, s3, reset=False)
    with TestClient(create_app(lb=lb)) as client:
        register(client, "someone")  # a leaderboard with an account in it
    (tmp_path / "obj").write_bytes(b"x")
    lb.store.put("runs/1/x", tmp_path / "obj")
    lb.engine.dispose()
    assert _scaled(tmp_path / "b", tracks, db, s3, reset=False) is None  # refused without --reset
    assert "holds a leaderboard already; give empty ones, or --reset" in capsys.readouterr().err
    lb = _scaled(tmp_path / "c", tracks, db, s3, reset=True)
    err = capsys.readouterr().err
    assert "--reset: emptying the database postgresql+psycopg://witness:***@" in err and "(1 account(s)" in err
    assert f"{s3} (1 object(s))" in err
    lb.engine.dispose()


def test_sigterm_stops_the_scale_out_demo_and_its_workers(s3, tmp_path):
    folder = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "leaderboard", "demo", "--dir", str(folder), "--db",
                             fresh_postgres(), "--store", s3, "--workers", "2", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ | S3_ENV)
    try:
        _stopped_by_sigterm(proc, folder)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _procs_with(str(folder / "worker-")):
            os.kill(pid, 9)


def _stopped_by_sigterm(proc: subprocess.Popen, folder) -> None:
    deadline = time.monotonic() + 120
    while len(_procs_with(str(folder / "worker-"))) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the demo's workers did not start"
        time.sleep(0.2)
    proc.terminate()  # SIGTERM, as a service manager or `kill` sends it
    proc.wait(60)
    deadline = time.monotonic() + 40
    while _procs_with(str(folder / "worker-")):
        assert time.monotonic() < deadline, "the demo's workers outlived it"
        time.sleep(0.2)
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Permission denied" not in err, err
