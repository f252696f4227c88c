"""What people use a leaderboard for: a ranked table with a record history and the rejected runs
apart, runs with names and code links, badges that work in a README, and decisions the server
signs so that anyone can check them offline."""

from __future__ import annotations

import base64
import json
import re

import pytest
from fastapi.testclient import TestClient
from lbhelpers import (
    ONLINE_ALL,
    QUICK,
    Authed,
    make_settings,
    register,
    rejected_online_run,
    submit,
    train_and_certify,
)

from witness.cli import main
from witness.commit.signing import generate_key, public_hex, public_pem
from witness.leaderboard import client as C
from witness.leaderboard.app import create_app
from witness.leaderboard.db import Run
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """On the quick track two certified runs (one named, with a code link) and two rejected runs (they
    cheated); on an online track a run certified from the steps replayed while it trained, and one
    rejected while it trained, two of whose selected steps never got their samples."""
    tmp = tmp_path_factory.mktemp("board")
    lb = Leaderboard(make_settings("sqlite", tmp, public_url="https://board.example.org",
                                   tracks=(parse_track(QUICK), parse_track(ONLINE_ALL)),
                                   registrations_per_hour=100))  # all from one test address
    ids = {}
    with TestClient(create_app(lb=lb)) as tc:
        # trudy cheats at steps 7..9 of a segment that starts at checkpoint 5: after step 7 fails,
        # the challenges at 8 and 9 replay steps 5..7 again from that checkpoint
        for name, cheat in (("alice", None), ("bob", None), ("mallory", {s: 2.0 for s in range(5, 15)}),
                            ("trudy", {7: 2.0, 8: 2.0, 9: 2.0})):
            t = register(tc, name)
            run_id, bundle, cert = train_and_certify(tc, t, tmp / name, lr_cheat=cheat)
            submit(tc, t, bundle, cert)
            ids[name] = run_id
            if name == "alice":
                r = Authed(tc, t.token)
                r.client.patch(f"/api/runs/{run_id}", headers=r.headers, json={
                    "title": "warmup <b>x</b>", "description": "linear warm-up", "code_url": "https://example.org/a"})
        work(lb, once=True)
        dave = register(tc, "dave")
        ids["dave"] = C.train_ticketed(Authed(tc, dave.token), "all", dave.key, tmp / "dave",
                                       C.TicketedRun(checkpoint_every=5, online=True))[0]
        work(lb, once=True)  # the selected steps replayed while the run is still open, before its submission
        submit(tc, dave, tmp / "dave", C.write_evaluation(tmp / "dave", dave.key, tmp / "dave.eval.json"))
        work(lb, once=True)
        ids["oscar"] = rejected_online_run(tc, register(tc, "oscar"), lb, tmp / "oscar")
        yield lb, tc, ids, tmp


def test_the_track_ranks_certified_runs_and_keeps_rejected_ones_apart(board):
    lb, tc, ids, _ = board
    page = tc.get("/tracks/quick").text
    ranking = page[page.index('id="runs"'):page.index('id="rejected"')]
    rejected = page[page.index('id="rejected"'):]
    assert ranking.count('class="run"') == 2 and f'href="/runs/{ids["mallory"]}"' not in ranking
    assert rejected.count('class="run"') == 2 and f'href="/runs/{ids["mallory"]}"' in rejected
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


# --- pages that say what they prove --------------------------------------------------------


def _text(html: str) -> str:
    """A page's text, tags dropped and spaces collapsed (what a reader sees)."""
    import html as h

    return " ".join(h.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", "", html, flags=re.S))).split())


def _by_id(html: str, ident: str) -> str:
    """The text of the element with this id (up to its closing tag of the same name)."""
    m = re.search(rf'<(\w+)[^>]*\bid="{ident}"[^>]*>', html)
    assert m, f"no element #{ident}"
    end = html.index(f"</{m.group(1)}>", m.end())
    return _text(html[m.end():end])


def test_figures_are_rounded_for_reading_and_bounds_the_safe_way():
    from witness.leaderboard.views import (
        bound_text,
        fraction_down,
        number,
        percent_down,
        percent_up,
        step_ranges,
    )

    # a bound is rounded down, never up: 99.99 % is not 100 %, and 0.98999 is not 99.0 %
    assert percent_down(0.99999) == "99.9" and percent_down(0.98999) == "98.9" and percent_down(0.99) == "99.0"
    assert percent_down(1.0) == "100" and percent_down(0.9999999, 2) == "99.99"
    # the bad fraction it holds against is rounded up (a claim against >= 5.01 % is not one against >= 5 %)
    assert percent_up(0.05) == "5" and percent_up(0.05001) == "5.01" and percent_up(0.0500001) == "5.01"
    assert bound_text(0.994079, 0.05) == "≥ 99.4 % against ≥ 5 % bad steps"
    assert bound_text(1.0, 0.05) == "100 % against ≥ 5 % bad steps"
    assert fraction_down(0.784557) == "0.7845" and fraction_down(0.5) == "0.5"
    assert number(0.44662367490582255) == "0.4466" and number(256) == "256" and number(0.875) == "0.875"
    assert step_ranges([3, 0, 1, 2, 7, 9, 10]) == "0–3, 7, 9–10"


def test_the_track_page_leads_with_the_ranking_and_explains_its_bound_column(board):
    lb, tc, ids, _ = board
    page = tc.get("/tracks/quick").text
    # the ranking comes first; the recipe after it, collapsed
    assert page.index('id="runs"') < page.index('id="history-plot"') < page.index('id="recipe"')
    assert re.search(r'<details id="recipe-details">\s*<summary>', page) and "<details id=\"recipe-details\" open" not in page
    header = re.search(r'<a id="sort-bound"[^>]*>(.*?)</a>', page).group(1)
    assert header.startswith("bound (≥ 5 % bad steps)")
    explained = _by_id(page, "bound-explained")
    assert "at least 5 % of its steps" in explained and "rounded down" in explained
    cells = re.findall(r'<td class="num bound" title="([^"]*)">([^<]*)</td>', page)
    assert cells == [("100 % against ≥ 5 % bad steps", "100 %")] * 2, cells
    assert "100.00%" not in page and "detection bound" not in page
    # a bound short of 1 is never shown as 100 %: rounded down
    with lb.Session() as s:
        run = s.get(Run, ids["bob"])
        kept, run.bound = run.bound, 0.99999
        s.commit()
    try:
        page = tc.get("/tracks/quick").text
        assert re.search(r'<td class="num bound" title="≥ 99.9 % against ≥ 5 % bad steps">≥ 99.9 %</td>', page)
        assert _by_id(tc.get(f"/runs/{ids['bob']}").text, "bound") == "≥ 99.9 % against ≥ 5 % bad steps"
        assert "certified: ≥ 99.9 % against ≥ 5 % bad steps" in tc.get(f"/runs/{ids['bob']}/badge.svg").text
    finally:
        with lb.Session() as s:
            s.get(Run, ids["bob"]).bound = kept
            s.commit()


def test_a_certified_run_says_what_its_bound_is_of_and_who_asked_for_which_challenges(board):
    lb, tc, ids, _ = board
    carol = register(tc, "carol")
    assert tc.post(f"/api/runs/{ids['alice']}/challenges", json={"count": 4},
                   headers={"Authorization": f"Bearer {carol.token}"}).status_code == 202
    work(lb, once=True)
    page = tc.get(f"/runs/{ids['alice']}").text
    # the bound names what it is of, with the fraction of bad steps it holds against
    assert _by_id(page, "bound") == "100 % against ≥ 5 % bad steps"
    badge = tc.get(f"/runs/{ids['alice']}/badge.svg").text
    assert "certified: 100 % against ≥ 5 % bad steps" in badge and "certified 100%" not in badge
    # challenges split by when and by whom: 20 at submission by the server, 4 later by carol; never one sum
    rows = [_text(r) for r in re.findall(r'<tr class="count" data-kind="\w+">(.*?)</tr>', page, flags=re.S)]
    assert len(rows) == 2, rows
    assert rows[0].startswith("at submission this server 20 20 0")
    assert re.match(r"later \(round \d+\) carol 4 4 0", rows[1]), rows[1]
    # no cell is the sum (a clock time such as 17:28:24 may hold the digits: count cells only)
    assert not re.search(r"(?<![\d:])24(?![\d:])", " ".join(rows)) and "replay challenge(s) drawn by the server matched" not in page
    # evaluation figures to 4 significant digits (the exact value in the title)
    values = re.findall(r'<td class="num agg" title="([^"]*)">([^<]*)</td>', page)
    assert values and all(len(re.sub(r"[^0-9]", "", shown).lstrip("0")) <= 4 for _, shown in values), values
    assert any(full != shown for full, shown in values)  # the mean loss, at least, is cut for reading
    # twenty steps that matched bit for bit are one line, not twenty rows
    assert "matched bit for bit: steps 0–19" in page and "bit-identical" not in page


def test_a_failed_replay_counts_each_step_once_and_never_more_than_the_run(board):
    lb, tc, ids, _ = board
    page = tc.get(f"/runs/{ids['trudy']}").text
    v = tc.get(f"/api/runs/{ids['trudy']}").json()["verdict"]
    assert v["steps"] == 20 and v["challenges"] == 20
    # steps 0..6 replayed and matched, 7 failed (8 and 9 then fail at 7 again, from checkpoint 5, and
    # reach nothing new), 10..19 matched: 18 distinct steps, whatever the verifier's pass count says
    assert "18 distinct step(s) replayed at submission = 90.00 % of the run's 20 steps" in _by_id(page, "submission-replay")
    shares = [float(x) for x in re.findall(r"([0-9]+(?:\.[0-9]+)?) %", _text(page))]
    assert shares and max(shares) <= 100
    # each round lists each step once
    for rnd in tc.get(f"/api/runs/{ids['trudy']}/challenges").json():
        steps = [c["step"] for c in rnd["challenges"]]
        assert len(steps) == len(set(steps))
    assert "matched bit for bit: steps 0–6, 10–19" in page


def _reaudit(tc, page: str, tmp_path) -> int:
    """Download the bundle by the name the page gives, run the page's command in a shell; its exit status."""
    import os
    import subprocess
    import sys

    link = re.search(r'<a href="(/runs/\d+/download/submission.tar)">([^<]+)</a>', page)
    (tmp_path / link.group(2)).write_bytes(tc.get(link.group(1)).content)
    command = _by_id(page, "reaudit")
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, timeout=600).returncode


def test_every_run_page_gives_the_command_that_re_audits_its_bundle(board, tmp_path):
    lb, tc, ids, _ = board
    expect = {"alice": (0, "--mode offline"), "trudy": (1, "--mode offline"),
              "dave": (0, f"--mode online --beacon-key {lb.public_key}")}
    for name, (rc, mode) in expect.items():
        page = tc.get(f"/runs/{ids[name]}").text
        command = _by_id(page, "reaudit")
        assert command.startswith(f"mkdir -p run-{ids[name]} && tar -xf run-{ids[name]}-submission.tar") and mode in command
        assert f"--ticket {tc.get(f'/api/runs/{ids[name]}').json()['r']}" in command
        (tmp_path / name).mkdir()
        assert _reaudit(tc, page, tmp_path / name) == rc, name  # trudy's cheat is caught again: exit 1
    # a run rejected while it trained submitted no bundle: its page says so, and gives no command
    page = tc.get(f"/runs/{ids['oscar']}").text
    assert 'id="reaudit"' not in page and "nothing to re-audit" in _by_id(page, "reaudit-none")


def test_an_online_run_shows_the_steps_replayed_while_it_trained(board):
    lb, tc, ids, _ = board
    r = tc.get(f"/api/runs/{ids['dave']}").json()
    live, later = r["online"]["while_training"], r["online"]["at_submission"]
    assert r["status"] == "certified" and live > 0 and live + later == r["online"]["selected"] == 20
    page = tc.get(f"/runs/{ids['dave']}").text
    assert _by_id(page, "online-live") == f"{live} replayed and matched while it trained"
    row = _text(re.search(r'<tr class="count" data-kind="online">(.*?)</tr>', page, flags=re.S).group(1))
    assert row.startswith("while it trained") and f" {live} step(s) {live} 0 " in row
    replay = _by_id(page, "submission-replay")
    assert f"{live} of them replayed while the run trained" in replay
    assert f"{later} distinct step(s) replayed at submission = {100 * later / 20:.2f} %" in replay


def test_a_rejected_run_never_shows_work_as_pending(board):
    lb, tc, ids, _ = board
    r = tc.get(f"/api/runs/{ids['oscar']}").json()
    assert r["status"] == "rejected"
    o = r["online"]
    # steps 8 and 9 were selected and never got their samples: not pending, never replayed
    assert o["waiting"] == 0 and o["ready"] == 0 and o["not_replayed"] == 2 and o["failed"] >= 1
    page = tc.get(f"/runs/{ids['oscar']}").text
    assert "awaiting their state" not in page and "being replayed" not in page
    assert _by_id(page, "online-not-replayed") == "2 never replayed: the run was rejected first"
    track = tc.get("/tracks/all").text
    assert f'href="/runs/{ids["oscar"]}"' in track[track.index('id="rejected"'):track.index("</table>", track.index('id="rejected"'))]
    assert 'id="waiting"' not in track or f'href="/runs/{ids["oscar"]}"' not in track[track.index('id="waiting"'):]


def test_two_online_rounds_never_replay_one_step_into_the_history_twice(board, tmp_path, monkeypatch):
    lb, tc, ids, _ = board
    from witness.leaderboard import online, queue
    from witness.leaderboard.worker import process

    frank = register(tc, "frank")
    run_id = C.train_ticketed(Authed(tc, frank.token), "all", frank.key, tmp_path / "run",
                              C.TicketedRun(checkpoint_every=5, online=True))[0]
    with lb.Session() as s:  # a second online job, as when a step came ready while another job ran
        queue.enqueue(s, run_id, "online", 1)
        s.commit()
    real, nested = online.verify_round, []

    def racing(*a, **kw):
        """While the first job replays, a second worker takes the other job and replays the same steps."""
        if not nested:
            nested.append(True)
            with lb.Session() as s:
                job = queue.claim(s, "other-worker")
            process(lb, job, "other-worker")
        return real(*a, **kw)

    monkeypatch.setattr(online, "verify_round", racing)
    assert work(lb, once=True) == 1 and nested  # (the nested job was done by the other worker)
    rounds = tc.get(f"/api/runs/{run_id}/challenges").json()
    steps = [c["step"] for rnd in rounds for c in rnd["challenges"]]
    assert steps and len(steps) == len(set(steps)), steps  # each step decided by one round
    assert all(rnd["count"] == len(rnd["challenges"]) for rnd in rounds)
    o = tc.get(f"/api/runs/{run_id}").json()["online"]
    assert o["verified"] == len(steps) == o["while_training"]
