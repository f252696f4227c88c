"""drand over HTTP (witness.beacon.drand): the client against the local drand-compatible endpoint on
loopback, against endpoints that lie, and ``witness drand serve`` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from witness.beacon.drand import MAX_DRAND_ANSWER, DrandClient, DrandError, LocalDrand, create_app
from witness.commit.drand import QUICKNET, chain_info, current_round, round_after, round_time
from witness.commit.hashing import sha256
from witness.web import start_uvicorn, stop_uvicorn

GENESIS = int(time.time()) - 1000  # a chain with a thousand rounds already (period 1 s)


@pytest.fixture(scope="module")
def local() -> LocalDrand:
    return LocalDrand(seed=b"witness drand http test", period=1, genesis_time=GENESIS)


@pytest.fixture(scope="module")
def served(local):
    server, thread, url = start_uvicorn(create_app(local))
    yield url
    stop_uvicorn(server, thread)


class Lying:
    """An endpoint that answers every round request as ``mode`` says (a test sets it), with ``signer``'s rounds."""

    def __init__(self, signer: LocalDrand):
        self.signer, self.mode = signer, "honest"
        app = self.app = FastAPI()

        @app.get("/{chain}/info")
        def info(chain: str) -> dict:
            return self.signer.chain.to_json()

        @app.get("/{chain}/public/{round}")
        def public(chain: str, round: int) -> Response:
            body = self.signer.beacon(round)
            if self.mode == "flip":
                sig = bytearray(bytes.fromhex(body["signature"]))
                sig[20] ^= 0x04
                body = {**body, "signature": sig.hex(), "randomness": sha256(bytes(sig)).hex()}
            elif self.mode == "next round":  # a valid round, of another number than asked for
                body = self.signer.beacon(round + 1)
            elif self.mode == "wrong round field":
                body = {**body, "round": round + 1}
            elif self.mode == "randomness":
                body = {**body, "randomness": "00" * 32}
            elif self.mode == "huge":
                return Response(json.dumps({**body, "pad": "x" * MAX_DRAND_ANSWER}), media_type="application/json")
            elif self.mode == "not json":
                return Response(b"<html>\x1b[31mhello</html>", media_type="text/html")
            elif self.mode == "extra field":
                body = {**body, "note": "trust me"}
            elif self.mode == "too early":
                return JSONResponse({"detail": "Requested future beacon"}, 425)
            elif self.mode == "teapot":
                return JSONResponse({"detail": "no"}, 418)
            return JSONResponse(body)


@pytest.fixture(scope="module")
def lying(local):
    endpoint = Lying(local)
    server, thread, url = start_uvicorn(endpoint.app)
    endpoint.url = url
    yield endpoint
    stop_uvicorn(server, thread)


def test_fetches_and_verifies_rounds(local, served):
    with DrandClient(served, local.chain) as client:
        assert client.info() == local.chain
        for round in (1, 500, local.latest()):
            signature, randomness = client.fetch(round)
            assert signature == local.sign(round) and randomness == sha256(signature)


def test_local_endpoint_speaks_drands_api(local, served):
    h = local.chain.hash.hex()
    assert httpx.get(f"{served}/info").json() == httpx.get(f"{served}/{h}/info").json() == local.chain.to_json()
    latest = httpx.get(f"{served}/{h}/public/latest").json()
    assert latest["round"] >= 1000 and set(latest) == {"round", "randomness", "signature"}
    assert httpx.get(f"{served}/{h}/public/0").json()["round"] >= latest["round"]  # 0: the latest, as drand
    assert httpx.get(f"{served}/{h}/public/7").json() == local.beacon(7)
    future = httpx.get(f"{served}/{h}/public/{local.latest() + 5}")
    assert future.status_code == 425 and "future" in future.json()["detail"]
    assert httpx.get(f"{served}/{'00' * 32}/public/7").status_code == 400  # a chain it does not serve
    for bad in ("-1", "1e3", "x", "9" * 30):
        assert httpx.get(f"{served}/{h}/public/{bad}").status_code == 400
    assert local.chain.beacon_id == "witness-local" and local.chain.hash == local.chain.computed_hash()
    assert chain_info_file_roundtrip(local)


def chain_info_file_roundtrip(local: LocalDrand) -> bool:
    again = LocalDrand(seed=b"witness drand http test", period=1, genesis_time=GENESIS)
    return again.chain == local.chain and again.sign(9) == local.sign(9) \
        and LocalDrand(period=1, genesis_time=GENESIS).chain != local.chain  # no seed: a fresh key


def test_waits_for_a_future_round(local, served):
    round = round_after(local.chain, time.time())  # due within the second
    with DrandClient(served, local.chain) as client:
        signature, _ = client.fetch(round)
    assert time.time() >= round_time(local.chain, round) and signature == local.sign(round)


def test_asks_again_while_the_round_is_too_early(local):
    # an endpoint whose clock runs behind ours answers 425 for a while after the round is due here
    class Late(LocalDrand):
        def latest(self, now: float | None = None) -> int:
            return super().latest(time.time() - 0.6 if now is None else now)

    late = Late(seed=b"witness drand http test", period=1, genesis_time=GENESIS)
    server, thread, url = start_uvicorn(create_app(late))
    try:
        round = round_after(local.chain, time.time())
        with DrandClient(url, local.chain, patience=10) as client:
            assert client.fetch(round)[0] == local.sign(round)
        assert time.time() >= round_time(local.chain, round) + 0.6
    finally:
        stop_uvicorn(server, thread)


def test_gives_up_after_its_patience(local, lying):
    lying.mode = "too early"
    started = time.monotonic()
    with DrandClient(lying.url, local.chain, patience=0.6) as client, \
            pytest.raises(DrandError, match=r"gave no round 10 .* within 1 s .*HTTP 425"):
        client.fetch(10)
    assert time.monotonic() - started < 3


def test_an_endpoint_of_another_chain_is_refused(local, served):
    other = LocalDrand(seed=b"another chain", period=1, genesis_time=GENESIS)
    with DrandClient(served, other.chain) as client:
        with pytest.raises(DrandError, match=f"at {served} refused round 10 .*unknown chain hash"):
            client.fetch(10)
    # one that answers under any chain hash: its info is not the pinned chain, its rounds do not verify
    endpoint = Lying(other)
    server, thread, url = start_uvicorn(endpoint.app)
    try:
        with DrandClient(url, local.chain) as client:
            with pytest.raises(DrandError, match="serves drand chain witness-local .*not the pinned"):
                client.info()
            with pytest.raises(DrandError, match="does not verify: .*round 10: the signature does not verify"):
                client.fetch(10)
        with DrandClient(url, QUICKNET) as client, pytest.raises(DrandError, match="not the pinned drand chain quicknet"):
            client.info()
    finally:
        stop_uvicorn(server, thread)


@pytest.mark.parametrize("mode,message", [
    ("flip", "does not verify"),
    ("next round", "answered round 10 .* with round 11"),
    ("wrong round field", "with round 11"),
    ("randomness", "not SHA-256 of its signature"),
    ("huge", f"over {MAX_DRAND_ANSWER} bytes; refused"),
    ("not json", r"not JSON .*<html>\\x1b\[31mhello"),
    ("extra field", "with no drand round"),
    ("teapot", "refused round 10 .*HTTP 418"),
])
def test_a_lying_endpoint_is_refused(local, lying, mode, message):
    lying.mode = mode
    with DrandClient(lying.url, local.chain, patience=1) as client, pytest.raises(DrandError, match=message) as e:
        client.fetch(10)
    assert lying.url in str(e.value)


def test_an_honest_lying_endpoint_passes(local, lying):
    lying.mode = "honest"  # the same endpoint, telling the truth: what the refusals above are measured against
    with DrandClient(lying.url, local.chain) as client:
        assert client.fetch(10)[0] == local.sign(10)


def test_unreachable_and_bad_urls(local):
    with DrandClient("http://127.0.0.1:9", local.chain, patience=0.5, timeout=1) as client, \
            pytest.raises(DrandError, match="at http://127.0.0.1:9 gave no round .*ConnectError"):
        client.fetch(10)
    for url in ("", "127.0.0.1:8200", "ftp://x"):
        with pytest.raises(DrandError, match="not an http"):
            DrandClient(url, local.chain)
    with DrandClient("http://127.0.0.1:9", local.chain) as client:
        with pytest.raises(DrandError, match="cannot reach the drand endpoint at http://127.0.0.1:9: ConnectError"):
            client.info()
        with pytest.raises(DrandError, match="due in .* later than this client waits"):
            client.fetch(local.latest() + 10_000)
        with pytest.raises(ValueError, match="a drand round is an integer"):
            client.fetch(0)


def test_the_local_endpoint_is_never_quicknet(local):
    assert local.chain.beacon_id != QUICKNET.beacon_id and local.chain.hash != QUICKNET.hash
    assert "secret" not in repr(local) and str(local._secret) not in repr(local)


def test_cli_serves_a_chain_a_verifier_pins(tmp_path: Path):
    info = tmp_path / "chain.json"
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "drand", "serve", "--port", "0", "--period", "1",
                             "--info-out", str(info)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert " at http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.rsplit(" at ", 1)[1].strip()
        chain = chain_info(str(info))  # what a verifier pins with --drand FILE
        assert chain.beacon_id == "witness-local" and chain.hash.hex() in line
        with DrandClient(url, chain) as client:
            assert client.info() == chain
            signature, randomness = client.fetch(current_round(chain, time.time()))  # round 1 at least
            assert randomness == sha256(signature)
    finally:
        proc.terminate()
        proc.wait(10)


def test_drands_discovery_routes_name_the_chain_and_its_health(local, served):
    """drand's clients and monitors discover a relay by ``GET /chains`` (the hashes it serves) and check
    it by ``GET /health`` and ``/{hash}/health`` (the round it has and the round due now, 200 when at
    most one behind), as drand's http server answers them."""
    h = local.chain.hash.hex()
    assert httpx.get(f"{served}/chains").json() == [h]
    for path in ("/health", f"/{h}/health"):
        r = httpx.get(f"{served}{path}")
        body = r.json()
        assert r.status_code == 200 and set(body) == {"current", "expected"}
        assert body["expected"] - 1 <= body["current"] <= body["expected"] and body["current"] >= 1000
    assert httpx.get(f"{served}/{'00' * 32}/health").status_code == 400  # a chain it does not serve


def test_cli_on_a_taken_port_says_so_in_one_line(tmp_path: Path):
    """``witness drand serve --port <taken>``: one line naming the port, exit 2, no traceback (issue 52, item 8)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "witness.cli", "drand", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"did not start on 127.0.0.1:{port} (is the port taken?)" in done.stderr


def test_an_endpoint_that_trickles_its_headers_costs_one_attempt_not_the_run(tmp_path: Path):
    """An endpoint that sends its response headers a byte at a time (each read gets something, so no read
    times out): a round is given up within the patience, not waited for without end (issue 52, item 2)."""
    import socket
    import threading

    chain = LocalDrand(seed=b"t" * 32, period=1).chain
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            server.settimeout(0.5)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                    if stop.is_set():
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.2)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        started = time.monotonic()
        with DrandClient(url, chain, timeout=1.0, patience=3.0) as client, \
                pytest.raises(DrandError, match="gave no round"):
            client.fetch(current_round(chain, time.time()))
        assert time.monotonic() - started < 12
    finally:
        stop.set()
        thread.join(5)
        server.close()
