"""The server killed with SIGKILL during an upload and during a verification, on SQLite with the
local store and on PostgreSQL with the S3 store, then started again on the same database and store:
nothing is lost, nothing is decided twice, no half-stored run is served, and the queue drains within
a minute."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from lbhelpers import (
    QUICK,
    S3_ENV,
    fresh_postgres,
    fresh_s3,
    register,
    submit,
    train_and_certify,
    unfinished_s3,
)
from sqlalchemy import create_engine, func, select

from witness.leaderboard.db import Job, Round, Run
from witness.store import open_store, pack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``witness leaderboard serve`` as its own process group (server and workers)."""

    def __init__(self, db: str, store: str, work: Path, log: Path, env: dict[str, str]):
        self.db, self.store, self.work, self.log, self.env = db, store, work, log, env
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "witness.cli", "leaderboard", "serve", "--db", self.db, "--store",
               self.store, "--work", str(self.work), "--port", str(self.port), "--track", QUICK, "--workers", "1",
               "--orphan-after", "0"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=os.environ | self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/api/tracks", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not start: " + self.log.read_text()[-3000:])

    def kill(self) -> None:
        """SIGKILL the server and its workers at once, as a machine that loses power."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(params=["sqlite+local", "postgresql+s3"])
def crashing(request, tmp_path, monkeypatch):
    if request.param == "postgresql+s3":
        db, store, env = fresh_postgres(), fresh_s3(monkeypatch), S3_ENV
    else:
        db, store, env = f"sqlite:///{tmp_path / 'lb.db'}", str(tmp_path / "store"), {}
    server = Server(db, store, tmp_path / "work" if env else tmp_path / "store", tmp_path / "server.log", env)
    server.start()
    engine = create_engine(db)
    yield server, engine
    engine.dispose()
    if server.proc.poll() is None:
        server.kill()


def _status(url: str, run_id: int) -> str:
    return httpx.get(f"{url}/api/runs/{run_id}", timeout=10).json()["status"]


def test_a_server_killed_mid_upload_and_mid_verification_loses_nothing_and_decides_once(crashing, tmp_path):
    server, engine = crashing
    client = httpx.Client(base_url=server.url, timeout=60)
    alice = register(client, "alice")
    run_id, bundle, cert = train_and_certify(client, alice, tmp_path / "run")
    archive = pack(bundle, tmp_path / "submission.tar", cert)
    data = archive.read_bytes()

    # 1. killed while an upload's body arrives: half of it is on the server's disk
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + alice.token.encode()
                 + b"\r\nContent-Type: application/x-tar\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data[: len(data) // 2])
    incoming = server.work / "incoming"
    s3 = open_store(server.store, tmp_path / "probe") if server.env else None

    def half_stored() -> bool:
        unpacked = any(p.name.startswith("unpack-") for p in incoming.iterdir())  # being unpacked as it arrives
        if s3 is None:
            return unpacked and any(p.name.startswith("upload-") and p.stat().st_size > 0 for p in incoming.iterdir())
        return unpacked and bool(unfinished_s3(s3))  # the upload is in the bucket as it arrives

    deadline = time.monotonic() + 10
    while not half_stored() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert half_stored()
    server.kill()
    sock.close()
    server.start()
    assert list(incoming.iterdir()) == []  # the half upload is gone
    if s3 is not None:
        assert unfinished_s3(s3) == []  # its multipart upload aborted
    assert _status(server.url, run_id) == "ticketed"  # nothing was lost: the trainer submits again
    assert client.get(f"/runs/{run_id}/download/submission.tar").status_code == 404

    # 2. killed while its certification runs
    assert submit(client, alice, bundle, cert)["status"] == "pending"
    deadline = time.monotonic() + 60
    while (status := _status(server.url, run_id)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status == "verifying", status
    server.kill()
    with engine.connect() as c:  # the dead worker still holds the job
        assert c.execute(select(Job.status).where(Job.run_id == run_id, Job.kind == "certify")).scalar() == "running"
    # the files are there (written before the row), but only what a committed row names is served
    started = time.monotonic()
    server.start()
    while _status(server.url, run_id) in ("pending", "verifying") and time.monotonic() - started < 60:
        time.sleep(0.2)
    assert _status(server.url, run_id) == "certified"
    assert time.monotonic() - started < 60  # the queue drained within a minute
    with engine.connect() as c:
        jobs = c.execute(select(Job.status, Job.attempts).where(Job.run_id == run_id, Job.kind == "certify")).all()
        assert [s for s, _ in jobs] == ["done"] and jobs[0][1] == 2  # taken up again, decided once
        assert c.execute(select(func.count()).select_from(Round).where(Round.run_id == run_id)).scalar() == 1
        assert c.execute(select(Run.bundle_sha256).where(Run.id == run_id)).scalar()
    got = client.get(f"/runs/{run_id}/download/submission.tar")
    assert got.status_code == 200 and got.content == data
    with tarfile.open(fileobj=io.BytesIO(got.content)) as tf:
        assert "evaluation.json" in tf.getnames()
    assert client.get(f"/runs/{run_id}/download/model.safetensors").status_code == 200
    server.kill()
