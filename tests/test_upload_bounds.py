"""The leaderboard's uploads against hostile archives and ids: an extended tar header is bounded
before tarfile reads it and counts against the unpacked bytes, and an id too large for the tables
is a 400, never a 500."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import time
import tracemalloc

import pytest
from lbhelpers import make_settings, register
from starlette.testclient import TestClient

from witness.errors import MalformedInput
from witness.leaderboard.app import create_app
from witness.leaderboard.service import Leaderboard
from witness.store import MAX_TAR_META
from witness.store.archive import _unpack


def _header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _huge_pax(path, size: int = 256 << 20) -> None:
    """A gzip of a few hundred KB whose tar says: a pax header of ``size`` bytes (all zeros)."""
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(_header("././@PaxHeader", size, tarfile.XHDTYPE))
        zeros = bytes(1 << 20)
        for _ in range(size >> 20):
            f.write(zeros)
        f.write(bytes(1024))


@pytest.fixture
def app(tmp_path):
    lb = Leaderboard(make_settings("sqlite", tmp_path))
    with TestClient(create_app(lb=lb), raise_server_exceptions=False) as tc:
        yield tc


def test_a_huge_pax_header_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "up.tar.gz"
    _huge_pax(path)
    assert path.stat().st_size < 2 << 20
    (tmp_path / "out").mkdir()
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(MalformedInput, match=f"extended header; at most {MAX_TAR_META}"):
            _unpack(path, tmp_path / "out", 1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # it allocated 256 MB and more before
    assert time.monotonic() - started < 5


def test_extended_headers_count_against_the_unpacked_bytes(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(4):
            info = tarfile.TarInfo(f"bundle/f{i}")
            info.pax_headers = {"comment": "x" * 30_000}  # 30 KB of header for a 10-byte file
            info.size = 10
            tf.addfile(info, io.BytesIO(b"0123456789"))
    path = tmp_path / "a.tar"
    path.write_bytes(buf.getvalue())
    (tmp_path / "out").mkdir()
    with pytest.raises(MalformedInput, match="unpacks to more than the server's limit of 100000 bytes"):
        _unpack(path, tmp_path / "out", 100_000)  # 40 bytes of files, 120 KB of headers


def test_a_huge_pax_header_uploaded_as_a_submission_is_a_400(app, tmp_path):
    trainer = register(app, "pax")
    path = tmp_path / "up.tar.gz"
    _huge_pax(path, 64 << 20)
    r = app.post("/api/submissions", content=path.read_bytes(),
                 headers={"Authorization": f"Bearer {trainer.token}", "Content-Type": "application/x-tar"})
    assert r.status_code in (400, 422) and "extended header" in r.text, r.text


@pytest.mark.parametrize("path", ["/api/runs/{}", "/api/runs/{}/heads", "/api/runs/{}/certification",
                                  "/api/runs/{}/challenges", "/runs/{}", "/runs/{}/badge.svg"])
@pytest.mark.parametrize("run_id", [2**31, 2**63, 2**70, 0, -1])
def test_a_run_id_too_large_for_the_tables_is_a_400(app, path, run_id):
    r = app.get(path.format(run_id))
    assert r.status_code == 400, (path, run_id, r.status_code, r.text[:200])
    assert "run_id" in r.json()["detail"]


@pytest.mark.parametrize("run_id", [2**31, 2**70])
def test_an_online_upload_to_a_run_id_too_large_is_a_400(app, run_id):
    trainer = register(app, f"big{run_id % 97}")
    r = app.put(f"/api/runs/{run_id}/online/states/0", content=b"x" * 10,
                headers={"Authorization": f"Bearer {trainer.token}", "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "run_id" in r.json()["detail"], r.text


@pytest.fixture(params=["sqlite", "postgresql"])
def either(request, tmp_path):
    lb = Leaderboard(make_settings(request.param, tmp_path))
    with TestClient(create_app(lb=lb), raise_server_exceptions=False) as tc:
        yield tc
    lb.engine.dispose()


@pytest.mark.parametrize("field, bad", [("title", "a\x00b"), ("description", "\ud800"), ("code_url", "x\x00")])
def test_a_text_no_database_keeps_is_a_400_naming_its_field(either, field, bad):
    trainer = register(either, f"t{abs(hash((field, bad))) % 10**6}")
    body = json.dumps({"track": "quick", field: bad})  # the surrogate travels as JSON's \ud800 escape
    r = either.post("/api/tickets", content=body, headers={"Authorization": f"Bearer {trainer.token}",
                                                           "Content-Type": "application/json"})
    assert r.status_code == 400 and field in r.json()["detail"], r.text
    r = either.post("/api/accounts", content=json.dumps({"name": "n\x00", "public_key": "ab" * 32}),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("count", [2**31, 2**63, 2**70, -1, 0])
def test_a_challenge_count_out_of_range_is_a_4xx(either, count):
    trainer = register(either, f"c{abs(count) % 10**6}")
    r = either.post("/api/runs/1/challenges", json={"count": count},
                    headers={"Authorization": f"Bearer {trainer.token}"})
    assert 400 <= r.status_code < 500, r.text


def test_a_chain_of_extended_headers_is_refused_before_tarfile_recurses(app, tmp_path):
    trainer = register(app, "chain")
    pax = tarfile.TarInfo._create_pax_generic_header({"comment": "x"}, tarfile.XHDTYPE, "utf-8")
    member = tarfile.TarInfo("bundle/a")
    member.size = 1
    body = pax * 300 + member.tobuf(tarfile.USTAR_FORMAT) + b"a".ljust(512, b"\0") + bytes(1024)
    r = app.post("/api/submissions", content=body,
                 headers={"Authorization": f"Bearer {trainer.token}", "Content-Type": "application/x-tar"})
    assert r.status_code == 400 and "chains more than" in r.json()["detail"], r.text


@pytest.mark.parametrize("name", ["a%00b", "a%0A", "x" * 65])
def test_a_track_name_that_is_none_is_a_404(either, name):
    for path in (f"/api/tracks/{name}", f"/api/tracks/{name}/runs", f"/tracks/{name}"):
        assert either.get(path).status_code == 404, path


@pytest.mark.parametrize("planned", [None, "x", 1.5, 10**30, 0])
def test_an_online_manifest_without_a_whole_step_count_is_a_400(tmp_path, planned):
    from witness.commit.hashing import canonical_json, leaf_hash
    from witness.commit.signing import SignedTreeHead, generate_key, public_hex

    lb = Leaderboard(make_settings("sqlite", tmp_path))
    with TestClient(create_app(lb=lb), raise_server_exceptions=False) as c:
        key = generate_key()
        token = c.post("/api/accounts", json={"name": "eve", "public_key": public_hex(key.public_key())}).json()["token"]
        auth = {"Authorization": f"Bearer {token}"}
        t = c.post("/api/tickets", json={"track": "quick"}, headers=auth).json()
        m = {"type": "manifest", "r": t["r"], "public_key": public_hex(key.public_key()), "task": t["task"],
             "task_config": json.loads(canonical_json(t.get("config", t.get("task_config", {})))),
             "data_root": t["data_root"], "online": {"p": 0.5, "every": 1, "ring": 2}, "state_every": 1}
        if planned is not None:
            m["steps_planned"] = planned
        line = canonical_json(m)
        head = SignedTreeHead.sign(key, 1, leaf_hash(line))
        r = c.post(f"/api/runs/{t['run_id']}/heads", json={"tree_head": head.to_json(), "manifest": line.decode()},
                   headers=auth)
        assert r.status_code == 400 and "steps_planned" in r.json()["detail"], r.text
    lb.engine.dispose()
