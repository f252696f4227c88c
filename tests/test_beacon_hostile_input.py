"""The beacon against hostile input, on SQLite and PostgreSQL: every number and text is checked
before it reaches the database (a 4xx naming the field, never a 500), lists come a page at a time,
and one client address cannot flood it."""

from __future__ import annotations

import json

import pytest
from lbhelpers import fresh_postgres
from starlette.testclient import TestClient

from witness.beacon.app import create_app
from witness.beacon.service import MAX_HEAD_SIZE
from witness.cli import main
from witness.commit.log import RunLog
from witness.commit.signing import SignedTreeHead, generate_key, public_hex
from witness.web import RateLimit


@pytest.fixture(params=["sqlite", "postgresql"])
def http(request, tmp_path):
    db = f"sqlite:///{tmp_path / 'b.db'}" if request.param == "sqlite" else fresh_postgres()
    with TestClient(create_app(db, generate_key()), raise_server_exceptions=False) as client:
        yield client


def _log(key, records: int = 3, **manifest) -> RunLog:
    log = RunLog()
    log.append({"type": "manifest", "public_key": public_hex(key.public_key()), **manifest})
    for i in range(1, records):
        log.append({"type": "step", "step": i - 1})
    return log


def _first(log: RunLog, head: SignedTreeHead, proof: list[str] | None = None) -> dict:
    return {"tree_head": head.to_json(), "manifest": log.lines[0].decode(),
            "consistency": proof if proof is not None else [h.hex() for h in log.tree.consistency_proof(1, head.size)]}


@pytest.mark.parametrize("size", [2**31, 2**63, 2**64, 2**70])
def test_a_head_too_big_for_the_tables_is_a_400_naming_the_size(http, size):
    key = generate_key()
    log = _log(key)
    head = SignedTreeHead.sign(key, size, log.root())  # signed: the size is the only flaw
    r = http.post("/api/beacon/heads", json=_first(log, head, ["ab" * 32] * 40))
    assert r.status_code == 400, r.text
    assert f"size is at most {MAX_HEAD_SIZE}" in r.json()["detail"]


def test_the_largest_size_a_table_holds_is_refused_only_for_its_proof(http):
    key = generate_key()
    log = _log(key)
    head = SignedTreeHead.sign(key, MAX_HEAD_SIZE, log.root())
    r = http.post("/api/beacon/heads", json=_first(log, head, ["ab" * 32] * 31))
    assert r.status_code == 400 and "at most" not in r.json()["detail"]  # checked as any head is


@pytest.mark.parametrize("bad, field", [("\ud800", "manifest"), ("a\x00b", "manifest")])
def test_a_manifest_with_a_lone_surrogate_or_a_nul_is_a_400(http, bad, field):
    key = generate_key()
    log = _log(key)
    body = _first(log, log.sign_head(key))
    body["manifest"] = body["manifest"][:-1] + f',"note":"{bad}"}}'
    raw = json.dumps(body)  # the surrogate travels as JSON's \ud800 escape, as a hostile client sends it
    r = http.post("/api/beacon/heads", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith(f"{field}: holds a ")


@pytest.mark.parametrize("bad", ["\ud800", "\x00"])
def test_extensions_with_a_lone_surrogate_or_a_nul_are_a_400(http, bad):
    key = generate_key()
    log = _log(key)
    body = _first(log, log.sign_head(key))
    body["tree_head"]["extensions"] = {"note": bad}  # (its signature does not matter: refused before)
    r = http.post("/api/beacon/heads", content=json.dumps(body),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith("tree_head.extensions.note: holds a ")


@pytest.mark.parametrize("run", ["%00", "a%00b", "%ED%A0%80", "AB" * 32, "ab" * 31, "x" * 5000])
def test_a_run_name_that_is_not_one_is_a_404_never_a_500(http, run):
    r = http.get(f"/api/beacon/runs/{run}")
    assert r.status_code == 404, r.text
    assert "answered for no run" in r.json()["detail"]


@pytest.mark.parametrize("run", ["a\x00" * 32, "zz" * 32, 5])
def test_a_head_naming_a_run_that_is_no_run_name_is_a_400(http, run):
    key = generate_key()
    log = _log(key)
    r = http.post("/api/beacon/heads", content=json.dumps({"tree_head": log.sign_head(key).to_json(), "run": run}),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "run" in r.json()["detail"]


def test_the_runs_come_a_page_at_a_time(http):
    names = []
    for _ in range(5):
        key = generate_key()
        log = _log(key)
        assert http.post("/api/beacon/heads", json=_first(log, log.sign_head(key))).status_code == 200
        names.append(http.get("/api/beacon/runs?limit=1").json()[0]["run"])
    page = http.get("/api/beacon/runs?limit=2").json()
    assert [r["run"] for r in page] == names[::-1][:2]  # newest first
    assert [r["run"] for r in http.get("/api/beacon/runs?limit=2&offset=4").json()] == names[:1]
    for bad in ("limit=0", "limit=101", "offset=-1", f"offset={2**63}", "limit=x"):
        r = http.get(f"/api/beacon/runs?{bad}")
        assert r.status_code == 400 and r.json()["detail"].startswith("bad request: query."), (bad, r.text)


def test_one_address_that_floods_the_beacon_gets_429s(tmp_path):
    app = create_app(f"sqlite:///{tmp_path / 'b.db'}", generate_key(), per_minute=60, burst=20)
    with TestClient(app) as http:
        codes = [http.get("/api/beacon/key").status_code for _ in range(40)]
    assert codes[:20] == [200] * 20 and set(codes[20:]) == {429}  # 1,500 in a row all got 200 before
    r = TestClient(app).get("/api/beacon/key")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "60 requests a minute" in r.json()["detail"]


def test_the_rate_limit_refills_per_address_and_forgets_idle_ones():
    limit = RateLimit(None, per_minute=60, burst=2, clients=3)
    assert [limit.allow("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 1.0]
    assert limit.allow("b", now=0.0) == 0.0  # another address has its own bucket
    assert limit.allow("a", now=1.0) == 0.0  # a second later, a token more
    for c in "cdef":
        limit.allow(c, now=2.0)
    assert len(limit.buckets) == 3 and "a" not in limit.buckets  # bounded memory


def test_beacon_serve_refuses_a_bad_port_and_says_what_is_wrong_with_its_database(tmp_path, capsys):
    for port in ("70000", "-1", "x"):
        with pytest.raises(SystemExit):
            main(["beacon", "serve", "--port", port])
        assert "a port is 0 to 65535" in capsys.readouterr().err or port == "x"
    assert main(["beacon", "serve", "--db", str(tmp_path / "missing" / "b.db"), "--key", str(tmp_path / "k.pem")]) == 2
    assert "the folder" in capsys.readouterr().err
    url = "postgresql://someone:secret@127.0.0.1:1/nothing"
    assert main(["beacon", "serve", "--db", url, "--key", str(tmp_path / "k.pem")]) == 2
    err = capsys.readouterr().err
    assert "cannot open the database postgresql://someone:***@127.0.0.1:1/nothing" in err and "secret" not in err
    assert "Traceback" not in err


def test_beacon_serve_takes_a_sqlite_path(tmp_path):
    from witness.cli.beacon import database_url

    assert database_url(str(tmp_path / "b.db")) == f"sqlite:///{tmp_path / 'b.db'}"
    assert database_url("postgresql://h/db") == "postgresql://h/db"


def test_a_body_of_unterminated_strings_is_measured_in_one_pass(http):
    from witness.web import json_depth

    body = b'"' + b'\\"' * (128 << 10)  # every quote escaped: one string that never ends (quadratic before)
    assert json_depth(body) == 0 and json_depth(b'[[' + body) == 2
    r = http.post("/api/beacon/heads", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_extensions_over_their_bound_are_refused(http):
    key = generate_key()
    log = _log(key)
    head = SignedTreeHead.sign(key, len(log), log.root(), extensions={"pad": "x" * (70 << 10)})
    r = http.post("/api/beacon/heads", json=_first(log, head))
    assert r.status_code == 400 and "tree_head.extensions: over" in r.json()["detail"]


def test_a_run_caught_forking_keeps_one_proof_whatever_it_sends_after(http):
    key = generate_key()
    honest = _log(key, 6)
    assert http.post("/api/beacon/heads", json=_first(RunLog(honest.lines[:4]), RunLog(honest.lines[:4]).sign_head(key))).status_code == 200
    run = http.get("/api/beacon/runs?limit=1").json()[0]["run"]
    for salt in range(5):  # forks of the stamped size 4, each signed by the run's key
        fork = RunLog(honest.lines[:1])
        for i in range(1, 4):
            fork.append({"type": "step", "step": i - 1, "salt": salt})
        r = http.post("/api/beacon/heads", json={"tree_head": fork.sign_head(key).to_json(), "run": run,
                                                 "consistency": []})
        assert r.status_code == 409
    assert len(http.get(f"/api/beacon/runs/{run}").json()["evidence"]) == 1


def test_the_rate_limit_counts_an_ipv6_host_by_its_slash_64():
    from witness.web import client_key

    assert client_key("2001:db8::1") == client_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert client_key("10.0.0.1") == "10.0.0.1"


def test_several_worker_processes_keep_the_header_timeout(tmp_path):
    """``beacon serve --workers 2``: each worker process closes a connection that trickles its headers, as one
    process does (the limit travels to them by name and environment; issue 52, item 4)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "beacon", "serve", "--port", str(port), "--workers",
                             "2", "--header-timeout", "1", "--db", str(tmp_path / "b.db"), "--key",
                             str(tmp_path / "k.pem")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/api/beacon/key", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.3)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(6)]
        for c in socks:  # spread over both workers by the kernel; each trickles and never ends its headers
            c.sendall(b"GET /api/beacon/key HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for c in socks:
            c.settimeout(8)
            try:
                while c.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            c.close()
        assert time.monotonic() - started < 8  # every one closed by the timeout, none left open
        assert httpx.get(f"{url}/api/beacon/key", timeout=5).status_code == 200  # and the server serves on
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_stalled_or_abandoned_body_is_answered_and_logs_no_traceback(tmp_path, monkeypatch, caplog):
    """A body that stalls gets a 408 and its connection closed (it held it for ever before); one larger than
    add-checkpoint's bound is refused before more than that is buffered; a client gone mid-body leaves no
    traceback in the server's log (issue 52, items 3 and 6)."""
    import logging
    import socket
    import time

    from witness import web
    from witness.beacon.witness import MAX_BODY

    monkeypatch.setattr(web, "BODY_IDLE", 1.0)
    server, thread, url = web.start_uvicorn(create_app(f"sqlite:///{tmp_path / 'b.db'}", generate_key()))
    port = int(url.rsplit(":", 1)[1])
    try:
        with caplog.at_level(logging.WARNING):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /api/beacon/add-checkpoint HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"old 0\n")
            started, got = time.monotonic(), b""
            while chunk := s.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 408") and b"stalled" in got and time.monotonic() - started < 5
            s.close()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /api/beacon/add-checkpoint HTTP/1.1\r\nHost: x\r\nContent-Length: 900000\r\n\r\n"
                      + b"x" * (MAX_BODY + 1))
            assert s.recv(65536).startswith(b"HTTP/1.1 413")
            s.close()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)  # gone after 10 of 1000 bytes
            s.sendall(b"POST /api/beacon/add-checkpoint HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nold 0\nabc")
            s.close()
            time.sleep(1.5)
        assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()], \
            [r.getMessage() for r in caplog.records]
    finally:
        web.stop_uvicorn(server, thread)
