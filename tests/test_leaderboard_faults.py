"""Faults a public server meets: clients that trickle their headers or stall their uploads, and
clients that go away mid-upload. Each holds nothing for long, leaves no file behind, and logs one
line (never a traceback)."""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from lbhelpers import make_settings, register

from witness.leaderboard.app import create_app
from witness.leaderboard.service import Leaderboard
from witness.web import start_uvicorn, stop_uvicorn


@pytest.fixture
def live(tmp_path):
    lb = Leaderboard(make_settings("sqlite", tmp_path, header_timeout=1.0, body_idle_timeout=1.0))
    server, thread, url = start_uvicorn(create_app(lb=lb), header_timeout=lb.settings.header_timeout)
    try:
        yield lb, url
    finally:
        stop_uvicorn(server, thread)


def _connect(url: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the connection within ``seconds``, and what it sent first."""
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def _uploads_left(lb: Leaderboard) -> list[str]:
    return sorted(p.name for p in (lb.store.root / "incoming").iterdir())


def test_connections_that_trickle_their_headers_are_closed(live):
    lb, url = live
    socks = [_connect(url) for _ in range(8)]
    for s in socks:
        s.sendall(b"GET /api/tracks HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    started = time.monotonic()
    assert all(_closed_within(s, 5)[0] for s in socks)
    assert time.monotonic() - started < 5
    # a client that sends its headers in time is served, and its keep-alive connection too
    with httpx.Client(base_url=url) as c:
        assert c.get("/api/tracks").status_code == 200
        assert c.get("/api/tracks").status_code == 200


def test_a_stalled_upload_is_refused_and_leaves_no_file(live):
    lb, url = live
    token = register(httpx.Client(base_url=url), "stall").token
    s = _connect(url)
    s.sendall(b"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
              + b"\r\nContent-Type: application/x-tar\r\nContent-Length: 100000\r\n\r\n" + bytes(1000))
    started = time.monotonic()
    _, got = _closed_within(s, 10)
    assert got.startswith(b"HTTP/1.1 408") and b"the upload stalled" in got
    assert time.monotonic() - started < 5
    assert _uploads_left(lb) == []


def test_a_client_that_goes_away_mid_upload_leaves_no_file_and_one_log_line(live, caplog):
    lb, url = live
    token = register(httpx.Client(base_url=url), "gone").token
    caplog.set_level(logging.INFO)
    for _ in range(3):
        s = _connect(url)
        s.sendall(b"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                  + b"\r\nContent-Length: 100000\r\n\r\n" + bytes(5000))
        time.sleep(0.2)
        s.close()
    deadline = time.monotonic() + 5
    while _uploads_left(lb) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _uploads_left(lb) == []
    time.sleep(0.3)
    gone = [r for r in caplog.records if "went away during the upload" in r.getMessage()]
    assert len(gone) == 3 and not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in caplog.text


def test_files_stored_before_a_commit_that_never_came_are_not_served_and_are_removed_at_start(tmp_path):
    # A crash after the store took a submission's files (or a certification wrote the model and
    # plots) and before the commit that names them: the files exist, the row does not name them.
    from fastapi.testclient import TestClient
    from lbhelpers import train_and_certify

    from witness.leaderboard.db import Run
    from witness.leaderboard.recovery import recover
    from witness.store import Upload, archive_key, model_key, pack, plot_key

    lb = Leaderboard(make_settings("sqlite", tmp_path))
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
        archive = pack(bundle, lb.store.root / "incoming" / "upload-x.tar", cert)
        upload = Upload("0" * 64, archive.stat().st_size, str(archive), lb.store.unpack(archive, 1 << 30))
        lb.store.accept(run_id, upload)  # ... and then the crash
        for key, data in ((model_key(run_id), b"not yet decided"), (plot_key(run_id, "loss"), b"<svg/>")):
            path = lb.store.scratch("x")
            path.write_bytes(data)
            lb.store.put(key, path)
        for name in ("submission.tar", "evaluation.json", "model.safetensors"):
            assert tc.get(f"/runs/{run_id}/download/{name}").status_code == 404, name
        assert tc.get(f"/runs/{run_id}/plots/loss.svg").status_code == 404
        page = tc.get(f"/runs/{run_id}").text
        assert "download/submission.tar" not in page and "plots/loss.svg" not in page
        with lb.Session() as s:
            assert s.get(Run, run_id).status == "ticketed"
        done = recover(lb, orphan_after_s=0)
        assert done.run_folders_removed == 1 and not lb.store.exists(archive_key(run_id))
        assert not lb.store.local_bundle_root(run_id).exists()


def test_a_track_declares_its_own_upload_limit(tmp_path):
    from fastapi.testclient import TestClient
    from lbhelpers import QUICK, submit, train_and_certify

    from witness.leaderboard.client import LeaderboardError
    from witness.leaderboard.tracks import parse_track

    tight = parse_track("tight=tiny:steps=20,max_upload=20000@accuracy+")
    assert tight.max_upload == 20000 and "max_upload" not in tight.config  # not the recipe's
    with pytest.raises(ValueError, match="max_upload=BYTES"):
        parse_track("bad=tiny:max_upload=-1")
    lb = Leaderboard(make_settings("sqlite", tmp_path, tracks=(parse_track(QUICK), tight)))
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        small, bundle, cert = train_and_certify(tc, alice, tmp_path / "small", track="tight")
        with pytest.raises(LeaderboardError, match="over the server's limit of 20000 bytes"):
            submit(tc, alice, bundle, cert)  # its track's limit, not the server's 512 MiB
        run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "quick")
        assert submit(tc, alice, bundle, cert)["status"] == "pending"  # the quick track: the server's limit
