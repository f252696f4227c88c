"""The leaderboard from the command line, as a person uses it: serve, register, train, submit, challenge."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from lbhelpers import QUICK

from witness.cli import build_parser
from witness.leaderboard.cli import DEFAULT_STORE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _witness(*args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "witness.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _serve(tmp_path: Path, track: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``witness leaderboard serve`` with one worker on a free port, once it answers; its log is
    ``server.log`` and its store ``store/`` under ``tmp_path``."""
    url = f"http://127.0.0.1:{_free_port()}"
    log = tmp_path / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "witness.cli", "leaderboard", "serve", "--port",
                               url.rsplit(":", 1)[1], "--store", str(tmp_path / "store"), "--track", track,
                               "--workers", "1"], env=env, cwd=tmp_path, stderr=open(log, "w"))
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/api/tracks").status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.terminate()
            raise AssertionError(f"the server did not start: {log.read_text()}")
        time.sleep(0.3)


def test_serve_register_train_submit_challenge(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path / "home"), WITNESS_KEY=str(tmp_path / "home" / "key.pem"))
    env.pop("WITNESS_LEADERBOARD_TOKEN", None)
    server, url = _serve(tmp_path, QUICK, env)
    try:
        r = _witness("leaderboard", "register", "--leaderboard", url, "--name", "alice", env=env, cwd=tmp_path)
        assert r.returncode == 0 and "registered alice" in r.stdout, r.stderr
        assert oct((tmp_path / "home" / ".witness" / "leaderboard-tokens.json").stat().st_mode & 0o777) == "0o600"
        r = _witness("train", "--leaderboard", url, "--track", "quick", "--out", "run", "--quiet", env=env, cwd=tmp_path)
        assert r.returncode == 0 and "submit it with" in r.stdout, r.stderr
        r = _witness("submit", "run", "--leaderboard", url, "--wait", "--quiet", env=env, cwd=tmp_path)
        assert r.returncode == 0 and "run 1: certified" in r.stdout, r.stdout + r.stderr
        r = _witness("challenge", "1", "--leaderboard", url, "--count", "5", "--wait", env=env, cwd=tmp_path)
        assert r.returncode == 0 and "challenges passed" in r.stdout, r.stdout + r.stderr
        hist = httpx.get(f"{url}/api/runs/1/challenges").json()
        kinds = [h["kind"] for h in hist]
        # `train --leaderboard` takes online challenges: the server's workers may replay selected steps
        # while the run trains (online rounds), its certification replays the rest
        assert kinds[-2:] == ["certify", "rechallenge"] and set(kinds[:-2]) <= {"online"}, kinds
        assert all(h["passed"] for h in hist)
        assert httpx.get(f"{url}/api/runs/1").json()["verdict"]["mode"] == "online"
        # a second submission of the same run is refused with the server's reason, exit 2
        r = _witness("submit", "run", "--leaderboard", url, "--quiet", env=env, cwd=tmp_path)
        assert r.returncode == 2 and "409" in r.stderr and "submitted already" in r.stderr
        # writes without a token say how to get one
        r = _witness("challenge", "1", "--leaderboard", url, "--count", "1",
                     env=dict(env, HOME=str(tmp_path / "nobody")), cwd=tmp_path)
        assert r.returncode == 2 and "witness leaderboard register" in r.stderr
    finally:
        server.terminate()
        server.wait(30)
    # stopping the server stops its workers too
    deadline = time.monotonic() + 10
    while _processes_naming(str(tmp_path / "store")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(str(tmp_path / "store"))


def _processes_naming(text: str) -> list[int]:
    """PIDs whose command line contains ``text``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_server_defaults_to_loopback_and_the_local_store():
    args = build_parser().parse_args(["leaderboard", "serve"])
    assert args.host == "127.0.0.1" and args.store == DEFAULT_STORE and args.db is None
    assert args.presign is None


def test_presigned_downloads_and_the_cache_bound_need_an_s3_store(tmp_path):
    from witness.leaderboard.cli import settings_from

    def settings(*flags: str):
        return settings_from(build_parser().parse_args(["leaderboard", "serve", *flags]))

    with pytest.raises(ValueError, match="--presign needs an s3:// store"):
        settings("--store", str(tmp_path / "store"), "--presign")
    s3 = ("--store", "s3://bucket/prefix", "--db", "postgresql://x@127.0.0.1/db", "--work", str(tmp_path / "w"))
    with pytest.raises(ValueError, match="takes the store's address"):
        settings(*s3, "--presign", "ftp://store.example")
    assert settings(*s3, "--presign").presign_endpoint == ""  # the endpoint the server itself uses
    assert settings(*s3, "--presign", "https://store.example").presign_endpoint == "https://store.example"
    assert settings(*s3).presign_endpoint is None
    # the working folder's bound on unpacked bundles: S3 only, 50 GB unless told
    assert settings(*s3).cache_bytes == 50 * 10**9 and settings(*s3, "--cache-gb", "0.5").cache_bytes == 5 * 10**8
    assert settings("--store", str(tmp_path / "store")).cache_bytes is None
    with pytest.raises(ValueError, match="--cache-gb needs an s3:// store"):
        settings("--store", str(tmp_path / "store"), "--cache-gb", "1")
    with pytest.raises(ValueError, match="takes a size in GB"):
        settings(*s3, "--cache-gb", "nan")


def test_the_demo_fills_a_fresh_leaderboard(tmp_path, capsys):
    from sqlalchemy import create_engine, text

    from witness.leaderboard.demo import run_demo

    assert run_demo(tmp_path / "demo", port=0, serve=False) == 0
    out = capsys.readouterr().out
    assert out.count("CERTIFIED") == 4 and out.count("REJECTED") == 2 and "replay" in out
    dave = next(line for line in out.splitlines() if "by dave" in line)
    assert "CERTIFIED" in dave and "selected steps replayed while it trained" in dave
    alice = next(line for line in out.splitlines() if "by alice" in line)
    assert "90 challenges passed, bound 1.0000" in alice  # all 60 steps, then bob's 30 more
    engine = create_engine(f"sqlite:///{tmp_path / 'demo' / 'leaderboard.db'}")
    with engine.connect() as c:
        statuses = dict(c.execute(text("SELECT a.name, r.status FROM runs r JOIN accounts a ON a.id = r.account_id")).all())
        rounds = c.execute(text("SELECT kind, passed FROM rounds ORDER BY id")).all()
    engine.dispose()
    assert statuses == {"alice": "certified", "bob": "certified", "carol": "certified", "mallory": "rejected",
                        "dave": "certified", "eve": "rejected"}
    assert [tuple(r) for r in rounds][-1] == ("rechallenge", True)  # bob's extra challenges on alice's run
    assert any(kind == "online" and ok for kind, ok in rounds)  # dave's steps, replayed while he trained
    # a folder that is not a demo is left alone
    (tmp_path / "other").mkdir()
    assert run_demo(tmp_path / "other", port=0, serve=False) == 2


def _state(pid: int) -> str | None:
    """A process's state letter (Z for a zombie), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_worker_killed_mid_verification_is_replaced_and_the_run_decided_once(tmp_path):
    from lbhelpers import register, submit, train_and_certify
    from sqlalchemy import create_engine, text

    store, log = tmp_path / "store", tmp_path / "server.log"
    # verification takes seconds on this track: time to kill its worker in the middle
    server, url = _serve(tmp_path, "slow=tiny:steps=200@accuracy+")
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            alice = register(c, "alice")
            run_id, bundle, cert = train_and_certify(c, alice, tmp_path / "run", "slow", checkpoint_every=20)
            submit(c, alice, bundle, cert)
            deadline = time.monotonic() + 120
            while c.get(f"/api/runs/{run_id}").json()["status"] != "verifying":
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            workers = [p for p in _processes_naming(str(store)) if b"\x00worker\x00" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert len(workers) == 1
            os.kill(workers[0], 9)
            deadline = time.monotonic() + 300
            while (status := c.get(f"/api/runs/{run_id}").json()["status"]) in ("pending", "verifying"):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            assert status == "certified", c.get(f"/api/runs/{run_id}").json()
            assert _state(workers[0]) is None  # reaped: no zombie left behind
            hist = c.get(f"/api/runs/{run_id}/challenges").json()
            assert [h["kind"] for h in hist] == ["certify"] and hist[0]["passed"]  # decided exactly once
        engine = create_engine(f"sqlite:///{store.resolve() / 'leaderboard.db'}")
        with engine.connect() as conn:
            jobs = conn.execute(text("SELECT status, attempts FROM jobs")).all()
        engine.dispose()
        assert [tuple(j) for j in jobs] == [("done", 2)]  # taken twice: by the killed worker and its successor
        assert f"worker pid {workers[0]} exited with code -9; 1 job(s) it held queued again" in log.read_text()
    finally:
        server.terminate()
        server.wait(30)


def test_serve_runs_an_operator_log_only_with_its_witnesses_and_drand(tmp_path):
    import json

    from witness.beacon.drand import LocalDrand
    from witness.commit.note import COSIGNATURE_V1, NoteKey
    from witness.commit.signing import generate_key
    from witness.leaderboard.cli import settings_from
    from witness.leaderboard.tracks import parse_track

    def settings(*flags: str):
        return settings_from(build_parser().parse_args(["leaderboard", "serve", "--store", str(tmp_path / "s"), *flags]))

    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps(LocalDrand(seed=b"\x01" * 32, period=3).chain.to_json()))
    vkey = NoteKey.of("w1.example", generate_key().public_key(), COSIGNATURE_V1).vkey()
    w = settings("--operator-origin", "lb.example/log", "--witness", f"http://127.0.0.1:9/w={vkey}",
                 "--drand", "http://127.0.0.1:9", "--drand-chain", str(chain)).witnessing
    assert w.origin == "lb.example/log" and w.witnesses == (("http://127.0.0.1:9/w", vkey),) and w.chain["period"] == 3
    with pytest.raises(ValueError, match="needs the witnesses"):
        settings("--operator-origin", "lb.example/log", "--drand", "http://127.0.0.1:9", "--drand-chain", str(chain))
    with pytest.raises(ValueError, match="go with --operator-origin"):
        settings("--witness", f"http://127.0.0.1:9/w={vkey}")
    assert settings().witnessing is None
    # a track naming a witness is refused at start where the server has none of that name (or no log)
    track = parse_track("t=tiny:steps=20,online=0.5,witnesses=w1.example+w2.example,quorum=1@accuracy+")
    assert track.witnesses == ("w1.example", "w2.example") and track.quorum == 1
    with pytest.raises(ValueError, match="w2.example that the server is not configured with"):
        track.resolve(w)
    with pytest.raises(ValueError, match="runs no operator log"):
        track.resolve(None)
    with pytest.raises(ValueError, match="on a track with online=P"):
        parse_track("t=tiny:witnesses=w1.example@accuracy+")
    with pytest.raises(ValueError, match="quorum=K"):
        parse_track("t=tiny:online=0.5,witnesses=w1.example,quorum=2@accuracy+")
