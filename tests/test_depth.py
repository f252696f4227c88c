"""Untrusted JSON nested to any depth is unusable input (exit 2, or a 400), never a traceback or a 500.

Every reader of the command line and of the leaderboard's API is fed JSON nested 1 to 1,100
levels deep, where the parser used to give way at about 985 levels (Python's recursion limit), or
where the walks after it did: the canonical re-encoding, a recipe's canonical form.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from helpers import log_lines, train_tiny
from lbhelpers import make_settings, tar_bytes

from witness.bundle.layout import HEADS, LOG
from witness.cli import main
from witness.commit.hashing import (
    MAX_JSON_DEPTH,
    canonical_json,
    check_depth,
    load_json,
    parse_canonical_json,
)
from witness.commit.log import RunLog
from witness.commit.signing import generate_key, public_hex
from witness.leaderboard.app import create_app
from witness.leaderboard.service import ApiError, Leaderboard
from witness.store import Upload
from witness.verify.respond import respond
from witness.web import json_depth

DEPTHS = range(1, 1101)


def nested(depth: int) -> str:
    """A JSON array nested ``depth`` levels deep."""
    return "[" * depth + "]" * depth


def nested_value(depth: int) -> str:
    """An object whose one value is nested until the whole is ``depth`` levels deep (at least 1)."""
    return '{"a":' + nested(depth - 1) + "}" if depth > 1 else "{}"


def test_the_parsers_refuse_deep_nesting_at_every_depth():
    for d in DEPTHS:
        text = nested(d)
        assert json_depth(text.encode()) == d
        for parse in (load_json, lambda t: parse_canonical_json(t.encode())):
            if d <= MAX_JSON_DEPTH:
                assert parse(text) == json.loads(text)
            else:
                with pytest.raises(ValueError, match="nested|not valid JSON"):
                    parse(text)
    # brackets inside strings are text; the walk takes any depth without recursing
    assert json_depth(b'{"a":"[[[[[[","b":[{"c":"]]]"}]}') == 3
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested more than"):
        check_depth(deep)


def _sign_raw(bundle, key, lines: list[bytes]) -> None:
    """What a trainer holding its key can do with any bytes: make them the log and sign every prefix
    it signs (the manifest's, and the whole log's)."""
    (bundle / LOG).write_bytes(b"".join(line + b"\n" for line in lines))
    log = RunLog(lines)
    heads = [canonical_json(log.sign_head(key).to_json())]
    (bundle / HEADS).write_bytes(b"".join(h + b"\n" for h in heads))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("depth")
    key = generate_key()
    bundle = train_tiny(d / "b", key, config={"steps": 4}, checkpoint_every=2)
    respond(bundle, d / "resp", nonce=b"n", challenges=2)
    return d, bundle, key


def _cli(argv: list[str], capsys) -> int:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code


# Each case: (what it corrupts, a function (workdir, depth) -> argv) on a private copy of the run.
def _heads_line(w, d, key, pristine):
    lines = (w / "b" / HEADS).read_bytes().split(b"\n")
    (w / "b" / HEADS).write_bytes(nested(d).encode() + b"\n" + b"\n".join(lines[1:]))
    return ["verify", "--allow-weak", w / "b", "--challenges", "1", "--json"]


def _manifest_line(w, d, key, pristine):
    (w / "b" / LOG).write_bytes(b"\n".join([nested(d).encode(), *pristine[1:]]) + b"\n")
    return ["inspect", w / "b"]


def _signed_step(w, d, key, pristine):
    # a re-signed log whose second record is the nested value: the reader gets to parse it
    _sign_raw(w / "b", key, [pristine[0], nested(d).encode()])
    return ["verify", "--allow-weak", w / "b", "--challenges", "1"]


def _signed_recipe(w, d, key, pristine):
    # the manifest's recipe nested: refused as unusable once it nests past the limit
    recipe = b'"task_config":' + canonical_json(json.loads(pristine[0])["task_config"])
    assert recipe in pristine[0]
    _sign_raw(w / "b", key, [pristine[0].replace(recipe, b'"task_config":' + nested_value(d).encode()), *pristine[1:]])
    return ["verify", "--allow-weak", w / "b", "--challenges", "1"]


def _response(w, d, key, pristine):
    (w / "resp" / "response.json").write_text(nested(d))
    return ["verify", "--allow-weak", w / "b", "--mode", "interactive", "--response", w / "resp", "--nonce", "6e", "--challenges", "2"]


def _published_head(w, d, key, pristine):
    (w / "head.json").write_text(nested_value(d))
    return ["verify", "--allow-weak", w / "b", "--published-head", w / "head.json", "--challenges", "1"]


def _data_proof(w, d, key, pristine):
    (w / "proof.json").write_text(nested_value(d))
    return ["data", "check", w / "proof.json"]


def _certificate(w, d, key, pristine):
    (w / "cert.json").write_text(nested_value(d))
    return ["verify-eval", w / "cert.json", "--bundle", w / "b", "--spot", "1"]


CASES = {"heads.jsonl": _heads_line, "the manifest": _manifest_line, "a signed record": _signed_step,
         "a signed recipe": _signed_recipe, "response.json": _response, "--published-head": _published_head,
         "a data proof": _data_proof, "a certificate": _certificate}


@pytest.mark.parametrize("case", CASES)
def test_every_reader_of_the_command_line_refuses_any_depth(run, tmp_path, capsys, case):
    d0, bundle, key = run
    shutil.copytree(bundle, tmp_path / "b")
    shutil.copytree(d0 / "resp", tmp_path / "resp")
    make, pristine = CASES[case], log_lines(bundle)
    for d in DEPTHS:
        argv = make(tmp_path, d, key, pristine)
        code = _cli(argv, capsys)
        # a recipe nested within the limit is a recipe no task has (a rejected manifest); beyond it,
        # and anything else nested at all, is unusable input
        want = (1, 2) if make is _signed_recipe and d <= MAX_JSON_DEPTH else (2,)
        assert code in want, (case, d, code)


def _serve(tmp_path, requests) -> None:
    """Drive the leaderboard's whole ASGI app in process (every middleware included, no sockets):
    ``requests(client)`` is a coroutine given an ``httpx.AsyncClient`` on it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    lb = Leaderboard(make_settings("sqlite", tmp_path))

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(lb=lb)), base_url="http://lb") as c:
            await requests(c)

    try:
        asyncio.run(go())
    finally:
        lb.engine.dispose()


async def _account(c, name: str, key) -> tuple[dict, int]:
    r = await c.post("/api/accounts", json={"name": name, "public_key": public_hex(key.public_key())})
    auth = {"Authorization": f"Bearer {r.json()['token']}"}
    r = await c.post("/api/tickets", json={"track": "quick"}, headers=auth)
    return auth, r.json()["run_id"]


def test_every_json_body_of_the_api_refuses_any_depth(tmp_path):
    async def requests(c) -> None:
        auth, run_id = await _account(c, "depth-alice", generate_key())
        urls = ["/api/accounts", "/api/tickets", f"/api/runs/{run_id}/heads", f"/api/runs/{run_id}/challenges"]
        for d in DEPTHS:
            for url in urls:
                r = await c.post(url, content=nested_value(d), headers=auth | {"content-type": "application/json"})
                assert r.status_code in (400, 409, 422) if d <= MAX_JSON_DEPTH else r.status_code == 400, \
                    (url, d, r.status_code, r.text[:200])

    _serve(tmp_path, requests)


def _nested_manifest(d: int) -> str:
    """A manifest line whose recipe nests ``d`` levels deep."""
    return '{"task_config":' + nested(d) + ',"type":"manifest"}'


def test_a_streamed_manifest_and_an_uploaded_log_nested_at_any_depth_are_refused(tmp_path, run):
    # The server's own readers, at every depth: the first streamed head's manifest, and an uploaded
    # bundle's heads.jsonl (both refused, so the same ticket serves every depth).
    _, bundle, _ = run
    key = generate_key()
    files = {f"bundle/{name}": (bundle / name).read_bytes() for name in ("bundle.json", LOG)}
    lb = Leaderboard(make_settings("sqlite", tmp_path))
    archive = tmp_path / "upload.tar"
    try:
        with lb.Session() as s:
            acct, _ = lb.register(s, "depth-bob", public_hex(key.public_key()))
            run_id = lb.ticket(s, acct, "quick").id
            for d in DEPTHS:
                manifest = _nested_manifest(d)
                head = RunLog([manifest.encode()]).sign_head(key)
                with pytest.raises(ApiError) as info:
                    lb.add_head(s, acct, run_id, head.to_json(), [], manifest)
                assert info.value.status == 400, (d, info.value.message)  # within the limit: not this ticket's run
                if d > MAX_JSON_DEPTH:
                    assert info.value.message.startswith("manifest: ") and "nested" in info.value.message, d
                archive.write_bytes(tar_bytes(files | {f"bundle/{HEADS}": nested(d).encode() + b"\n",
                                                  "evaluation.json": b"{}"}))
                with pytest.raises(ApiError) as info:
                    lb.submit(s, acct, Upload("0" * 64, archive.stat().st_size, str(archive),
                                              lb.store.unpack(archive, 1 << 30)))
                assert info.value.status == 400 and "the bundle is not valid" in info.value.message, d
    finally:
        lb.engine.dispose()

    # and through HTTP, at the depths where something used to give way: a 400 with its reason, never a 500
    async def requests(c) -> None:
        auth, run_id = await _account(c, "depth-carol", key)
        for d in (1, 2, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, *range(975, 1000), 1100):
            manifest = _nested_manifest(d)
            head = RunLog([manifest.encode()]).sign_head(key)
            r = await c.post(f"/api/runs/{run_id}/heads", json={"tree_head": head.to_json(), "manifest": manifest},
                             headers=auth)
            assert r.status_code == 400, (d, r.status_code, r.text[:200])
            upload = tar_bytes(files | {f"bundle/{HEADS}": nested(d).encode() + b"\n", "evaluation.json": b"{}"})
            r = await c.post("/api/submissions", content=upload, headers=auth | {"content-type": "application/x-tar"})
            assert r.status_code == 400 and "the bundle is not valid" in r.text, (d, r.status_code, r.text[:200])

    _serve(tmp_path / "http", requests)
