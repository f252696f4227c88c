"""`witness train` against a hostile beacon: one that trickles its answers, falls silent, speaks
garbage, nests or pads its JSON without bound, or answers 500 forever. Training either goes on
within its stated patience or stops with one clear line, and its bundle continues with --resume."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from witness.beacon.app import create_app
from witness.cli import main
from witness.commit.signing import generate_key
from witness.web import start_uvicorn, stop_uvicorn


class Hostile:
    """ASGI middleware around a real beacon: after ``after`` heads (or at once, for ``/key``), it
    answers the way ``mode`` says."""

    def __init__(self, app, mode: str | None = None, after: int = 2, path: str = "/api/beacon/heads"):  # noqa: ANN001
        self.app, self.mode, self.after, self.path = app, mode, after, path
        self.seen = 0
        self.stopping = False

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or scope["path"] != self.path or self.mode is None:
            return await self.app(scope, receive, send)
        self.seen += 1
        if self.seen <= self.after:
            return await self.app(scope, receive, send)
        if self.mode == "slow":
            await asyncio.sleep(0.3)
            return await self.app(scope, receive, send)
        if self.mode == "silent":
            while not self.stopping:
                await asyncio.sleep(0.1)
            return None
        status, body = {"garbage": (200, b"\xff\xfe\x00 not json"), "500": (500, b'{"detail": "down"}'),
                        "deep": (200, b"[" * 200_000), "big": (200, b"[" * (2 << 20)),
                        "trickle": (200, b" " * 10_000)}[self.mode]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        if self.mode != "trickle":
            return await send({"type": "http.response.body", "body": body})
        for i in range(len(body)):  # a byte at a time, each well within any per-read timeout
            if self.stopping:
                return None
            await send({"type": "http.response.body", "body": body[i:i + 1], "more_body": True})
            await asyncio.sleep(0.2)
        return None


@pytest.fixture
def beacon(tmp_path):
    hostile = Hostile(create_app(f"sqlite:///{tmp_path / 'beacon.db'}", generate_key()))
    server, thread, url = start_uvicorn(hostile)
    hostile.url = url
    yield hostile
    hostile.stopping = True
    stop_uvicorn(server, thread)


def _train(tmp_path, url: str, *extra: str) -> list[str]:
    return ["train", "--task", "tiny", "--steps", "40", "--checkpoint-every", "10", "--seed", "hostile", "--key",
            str(tmp_path / "k.pem"), "--out", str(tmp_path / "run"), "--quiet", "--beacon", url,
            "--online-every", "4", "--online-p", "0.2", *extra]


def _one_clear_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("error") or x.startswith("cannot reach")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("mode, says", [
    ("silent", "sent no whole answer in"),
    ("trickle", "sent no whole answer in"),
    ("500", "refused the head of size"),
    ("garbage", "answered with something that is not JSON"),
    ("deep", "nested more than"),
    ("big", "answered with over 1048576 bytes"),
])
def test_a_hostile_beacon_stops_training_with_one_line_and_the_bundle_resumes(beacon, tmp_path, capsys, mode, says):
    beacon.mode = mode
    started = time.monotonic()
    assert main(_train(tmp_path, beacon.url, "--beacon-patience", "4")) == 2
    took = time.monotonic() - started
    line = _one_clear_line(capsys.readouterr().err)
    assert says in line and beacon.url in line, line
    assert took < 60, took  # within its patience (and a retry's pause), never for good
    beacon.mode = None  # the beacon behaves again: the run goes on from what it kept
    assert main([*_train(tmp_path, beacon.url), "--resume"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "4"]) == 0


def test_a_slow_beacon_within_its_patience_lets_training_finish(beacon, tmp_path, capsys):
    beacon.mode = "slow"
    assert main(_train(tmp_path, beacon.url, "--beacon-patience", "30")) == 0, capsys.readouterr().err


@pytest.mark.parametrize("mode", ["trickle", "silent", "garbage"])
def test_a_beacon_whose_key_never_comes_whole_stops_before_training(beacon, tmp_path, capsys, mode):
    beacon.mode, beacon.path, beacon.after = mode, "/api/beacon/key", 0
    started = time.monotonic()
    assert main(_train(tmp_path, beacon.url, "--beacon-patience", "3")) == 2
    assert time.monotonic() - started < 30
    line = _one_clear_line(capsys.readouterr().err)
    assert beacon.url in line
    assert not (tmp_path / "run").exists()  # nothing was trained, nothing to lose


def test_an_empty_beacon_url_is_refused(tmp_path, capsys):
    assert main(["train", "--task", "tiny", "--steps", "4", "--out", str(tmp_path / "r"), "--key",
                 str(tmp_path / "k.pem"), "--quiet", "--beacon", ""]) == 2
    assert "--beacon names no beacon" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _raw_server(answer: bytes):
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_compressed_answer_is_refused_before_it_is_inflated(tmp_path):
    import resource
    import zlib

    from witness.beacon.client import BeaconClient, BeaconError

    def gz(data: bytes) -> bytes:
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()
    body = gz(gz(bytes(200 << 20)))  # under a KB on the wire, 200 MB inflated
    srv = _raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip, gzip\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with pytest.raises(BeaconError, match="not the identity encoding asked for"):
            BeaconClient(f"http://127.0.0.1:{srv.getsockname()[1]}", retries=1)
    finally:
        srv.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: it inflated nothing


def test_a_refusal_cannot_write_control_characters_to_the_terminal():
    from witness.beacon.client import Answer, _detail

    said = _detail(Answer(400, b'{"detail": "bad\\u001b[2J\\u0007 head"}'))
    assert "\x1b" not in said and "\x07" not in said and "bad" in said and "head" in said


def test_a_beacon_outage_at_the_run_end_is_settled_by_resume(beacon, tmp_path, capsys):
    """The beacon goes down for longer than the patience as the run ends: training completes and
    exits 2 naming --resume, and --resume (the beacon back) sends the heads it never answered,
    rebuilds the states their statements select and finishes the audit: nothing is lost."""
    beacon.mode, beacon.after = "500", 13  # this run sends 14 heads: the final one finds the beacon down
    assert main(_train(tmp_path, beacon.url, "--beacon-patience", "2")) == 2
    err = capsys.readouterr().err
    assert "--resume" in _one_clear_line(err), err
    assert (tmp_path / "run" / "log.jsonl").read_bytes().count(b"\n") == 40 + 2  # the end record is written
    beacon.mode = None  # back
    assert main([*_train(tmp_path, beacon.url), "--resume"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*_train(tmp_path, beacon.url), "--resume"]) == 2  # settled now: nothing left to resume
    assert "already complete" in capsys.readouterr().err
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "4", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["accepted"] and verdict["complete"], verdict
