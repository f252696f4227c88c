"""What people use a leaderboard for: a ranked table with a record history and the rejected runs
apart, runs with names and code links, badges that work in a README, and decisions the server
signs so that anyone can check them offline."""

from __future__ import annotations

import base64
import json
import re

import pytest
from fastapi.testclient import TestClient
from lbhelpers import Authed, make_settings, register, submit, train_and_certify

from witness.cli import main
from witness.commit.signing import generate_key, public_hex, public_pem
from witness.leaderboard.app import create_app
from witness.leaderboard.db import Run
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.worker import work


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """Two certified runs (one named, with a code link) and one rejected run (it cheated)."""
    tmp = tmp_path_factory.mktemp("board")
    lb = Leaderboard(make_settings("sqlite", tmp, public_url="https://board.example.org"))
    ids = {}
    with TestClient(create_app(lb=lb)) as tc:
        for name, cheat in (("alice", None), ("bob", None), ("mallory", {s: 2.0 for s in range(5, 15)})):
            t = register(tc, name)
            run_id, bundle, cert = train_and_certify(tc, t, tmp / name, lr_cheat=cheat)
            submit(tc, t, bundle, cert)
            ids[name] = run_id
            if name == "alice":
                r = Authed(tc, t.token)
                r.client.patch(f"/api/runs/{run_id}", headers=r.headers, json={
                    "title": "warmup <b>x</b>", "description": "linear warm-up", "code_url": "https://example.org/a"})
        work(lb, once=True)
        yield lb, tc, ids, tmp


def test_the_track_ranks_certified_runs_and_keeps_rejected_ones_apart(board):
    lb, tc, ids, _ = board
    page = tc.get("/tracks/quick").text
    ranking = page[page.index('id="runs"'):page.index('id="rejected"')]
    rejected = page[page.index('id="rejected"'):]
    assert ranking.count('class="run"') == 2 and f'href="/runs/{ids["mallory"]}"' not in ranking
    assert rejected.count('class="run"') == 1 and f'href="/runs/{ids["mallory"]}"' in rejected
    ranks = re.findall(r'<td class="num rank">(\d+)</td>', ranking)
    metrics = [float(m) for m in re.findall(r'<td class="num metric">([0-9.]+)</td>', ranking)]
    assert ranks[0] == "1" and sorted(ranks) == ranks and metrics == sorted(metrics, reverse=True)
    # the recipe is a key/value table, not a JSON blob
    recipe = page[page.index('id="recipe"'):page.index("</table>", page.index('id="recipe"'))]
    assert "<th>steps</th><td><code>20</code></td>" in recipe and "{" not in recipe
    # the submitter's words are shown escaped, the code link kept
    assert "warmup &lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert 'href="https://example.org/a" rel="nofollow noopener noreferrer"' in page
    assert '<a id="code-link" href="https://example.org/a"' in tc.get(f"/runs/{ids['alice']}").text


def test_the_record_history_is_an_svg_drawn_by_the_server(board):
    lb, tc, ids, _ = board
    svg = tc.get("/tracks/quick/history.svg")
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    assert "<svg" in svg.text and "record history" in svg.text
    # the first certified run set the first record
    assert f"#{min(ids['alice'], ids['bob'])}" in svg.text
    assert tc.get("/tracks/nope/history.svg").status_code == 404


def test_a_code_link_must_be_http(board):
    lb, tc, ids, _ = board
    # only the owner may describe a run, and only with an http(s) link
    eve = register(tc, "eve")
    r = Authed(tc, eve.token)
    assert r.client.patch(f"/api/runs/{ids['bob']}", headers=r.headers, json={"title": "mine"}).status_code == 403
    with lb.Session() as s:
        assert s.get(Run, ids["bob"]).title is None
    for bad in ("javascript:alert(1)", "data:text/html,x", "https://x.org/\"onmouseover=\"x"):
        resp = tc.post("/api/tickets", json={"track": "quick", "code_url": bad},
                       headers={"Authorization": f"Bearer {eve.token}"})
        assert resp.status_code == 400 and "http(s)" in resp.json()["detail"], bad


def test_badge_snippets_are_absolute(board):
    lb, tc, ids, _ = board
    page = tc.get(f"/runs/{ids['alice']}").text
    snippet = re.search(r'<code id="badge-snippet">(.*?)</code>', page).group(1)
    assert snippet == (f"[![witness](https://board.example.org/runs/{ids['alice']}/badge.svg)]"
                       f"(https://board.example.org/runs/{ids['alice']})")
    assert "](/runs/" not in page


def _certification(tc, run_id, tmp_path):
    path = tmp_path / f"run-{run_id}.dsse.json"
    path.write_bytes(tc.get(f"/runs/{run_id}/download/certification.dsse.json").content)
    return path


def test_a_signed_certification_verifies_offline(board, tmp_path, capsys):
    lb, tc, ids, _ = board
    key = tc.get("/api/server-key").json()
    assert key["public_key"] == lb.public_key and key["pem"].startswith("-----BEGIN PUBLIC KEY-----")
    (tmp_path / "server.pub.pem").write_text(key["pem"])
    cert = _certification(tc, ids["alice"], tmp_path)
    model = tmp_path / "model.safetensors"
    model.write_bytes(tc.get(f"/runs/{ids['alice']}/download/model.safetensors").content)
    for server_key in (key["public_key"], str(tmp_path / "server.pub.pem")):
        assert main(["verify-certification", str(cert), "--server-key", server_key, "--model", str(model)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"CERTIFIED: run #{ids['alice']} on track 'quick'") and "all matched" in out
    assert main(["verify-certification", str(cert), "--server-key", lb.public_key, "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)
    stmt = decision["predicate"]
    assert decision["subjects"][0]["name"] == f"run-{ids['alice']}-model.safetensors"
    assert stmt["round"]["kind"] == "certify" and stmt["round"]["count"] == 20 and len(stmt["challenges"]) == 20
    assert stmt["bound"]["all_rounds"] == 1.0 and stmt["verdict"]["accepted"] is True
    assert stmt["run"]["trainer"] == "alice" and stmt["evaluation"]["metric"] == "accuracy"
    # the rejected run's decision is signed too, and says so (exit 1: valid, but not a certification)
    bad = _certification(tc, ids["mallory"], tmp_path)
    assert main(["verify-certification", str(bad), "--server-key", lb.public_key]) == 1
    assert capsys.readouterr().out.startswith(f"REJECTED: run #{ids['mallory']}")


def test_a_tampered_or_foreign_certification_is_refused(board, tmp_path, capsys):
    lb, tc, ids, _ = board
    env = json.loads(_certification(tc, ids["mallory"], tmp_path).read_text())
    stmt = json.loads(base64.b64decode(env["payload"]))
    # turn the rejection into a certification without the server's key
    stmt["predicate"]["decision"] = "certified"
    forged = dict(env, payload=base64.b64encode(json.dumps(stmt).encode()).decode())
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    assert main(["verify-certification", str(tmp_path / "forged.json"), "--server-key", lb.public_key]) == 1
    assert "signature is invalid" in capsys.readouterr().err
    # signed by another key: refused against the server's key
    other = generate_key()
    from witness.leaderboard.certification import sign_decision

    stmt["predicate"]["server"]["public_key"] = public_hex(other.public_key())
    (tmp_path / "other.json").write_text(sign_decision(other, stmt["subject"], stmt["predicate"]))
    assert main(["verify-certification", str(tmp_path / "other.json"), "--server-key", lb.public_key]) == 1
    assert "no signature on the envelope by the expected key" in capsys.readouterr().err
    # the right certification for another file
    cert = _certification(tc, ids["alice"], tmp_path)
    (tmp_path / "model.safetensors").write_bytes(tc.get(f"/runs/{ids['bob']}/download/model.safetensors").content)
    assert main(["verify-certification", str(cert), "--server-key", lb.public_key,
                 "--model", str(tmp_path / "model.safetensors")]) == 1
    assert "not about model.safetensors" in capsys.readouterr().err
    # not JSON, or far too large: unusable
    (tmp_path / "junk.json").write_bytes(b"\x00" * 100)
    assert main(["verify-certification", str(tmp_path / "junk.json"), "--server-key", lb.public_key]) == 2


def test_a_pem_key_registers_and_a_rechallenge_is_signed(board, tmp_path):
    lb, tc, ids, _ = board
    key = generate_key()
    acct = tc.post("/api/accounts", json={"name": "pem-user", "public_key": public_pem(key.public_key())}).json()
    token = acct["token"]
    before = json.loads(tc.get(f"/runs/{ids['bob']}/download/certification.dsse.json").content)
    assert tc.post(f"/api/runs/{ids['bob']}/challenges", json={"count": 3},
                   headers={"Authorization": f"Bearer {token}"}).status_code == 202
    work(lb, once=True)
    after = tc.get(f"/api/runs/{ids['bob']}/certification").json()
    assert after != before
    stmt = json.loads(base64.b64decode(after["payload"]))["predicate"]
    assert stmt["round"]["kind"] == "rechallenge" and stmt["decision"] == "certified"
    assert stmt["bound"]["challenges_passed"] == 23
