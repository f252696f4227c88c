"""The leaderboard's pages in real headless Chromium (Debian's package), driven by Playwright."""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
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
from playwright.sync_api import sync_playwright

from witness.leaderboard import client as C
from witness.leaderboard.demo import start_server
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium as root in a sandbox-less container, with no background traffic to a closed network
# (Playwright adds --headless and a fresh profile of its own).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREEN = {"width": 1280, "height": 900}  # the user test's screen: what is above the fold there counts


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A server with two certified runs (one re-challenged by bob later) and one rejected run, and on an
    online track a run certified from the steps replayed while it trained and one rejected while it trained."""
    tmp = tmp_path_factory.mktemp("site")
    lb = Leaderboard(make_settings("sqlite", tmp, tracks=(parse_track(QUICK), parse_track(ONLINE_ALL)),
                                   registrations_per_hour=100))
    server, thread, url = start_server(lb, port=0)
    ids = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        people = {}
        for name, cheat in (("alice", None), ("bob", None), ("mallory", {s: 2.0 for s in range(5, 15)})):
            t = people[name] = register(c, name)
            run_id, bundle, cert = train_and_certify(c, t, tmp / name, lr_cheat=cheat)
            submit(c, t, bundle, cert)
            ids[name] = run_id
        work(lb, once=True)
        C.challenge(Authed(c, people["bob"].token), ids["alice"], 4)  # bob doubts alice's run
        dave = register(c, "dave")
        ids["dave"] = C.train_ticketed(Authed(c, dave.token), "all", dave.key, tmp / "dave",
                                       C.TicketedRun(checkpoint_every=5, online=True))[0]
        work(lb, once=True)  # bob's round, and dave's selected steps while his run is still open
        submit(c, dave, tmp / "dave", C.write_evaluation(tmp / "dave", dave.key, tmp / "dave.eval.json"))
        work(lb, once=True)
        ids["eve"] = rejected_online_run(c, register(c, "eve"), lb, tmp / "eve")
    yield url, ids
    server.should_exit = True
    thread.join(30)


def _metrics(page) -> list[float | None]:
    return [float(t) if t.strip() else None for t in page.locator("#runs td.metric").all_inner_texts()]


def test_browse_sort_open_a_run_and_see_the_rejected_one(site, tmp_path):
    url, ids = site
    assert shutil.which("chromium"), "Debian's chromium package is missing: run scripts/services.sh"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport=SCREEN)
        page.goto(url + "/")
        page.get_by_role("link", name="quick").click()
        page.wait_for_selector("#runs")
        # the ranking leads: its rows are on the first screen, the recipe is collapsed below it
        assert page.locator("#runs tr.run").first.bounding_box()["y"] + 20 < SCREEN["height"]
        assert not page.locator("#recipe").is_visible() and page.locator("#recipe-details summary").is_visible()
        # the bound column says what it is, and the page explains it
        assert page.inner_text("#sort-bound").startswith("bound (≥ 5 % bad steps)")
        assert "at least 5 % of its steps" in page.inner_text("#bound-explained")
        assert page.locator("#runs td.bound").all_inner_texts() == ["100 %", "100 %"]
        # every entry links the exclusion proof that its evaluation split was never trained on
        assert page.locator("#runs td.clean").all_inner_texts() == ["proven", "proven"]
        proof = page.locator("#runs td.clean a").first.get_attribute("href")
        contamination = httpx.get(url + proof, follow_redirects=True).json()["contamination"]
        assert proof.endswith("/download/evaluation.json") and contamination["clean"] and contamination["documents"]
        assert all(d["absence"] for d in contamination["documents"])
        # the ranking holds the two certified runs, best accuracy first, ranked 1 and 2 (or 1 and 1)
        values = _metrics(page)
        assert len(values) == 2 and values[0] >= values[1]
        assert page.locator("#runs td.rank").all_inner_texts()[0] == "1"
        page.click("#sort-metric")  # ascending
        page.wait_for_url("**order=asc**")
        values = _metrics(page)
        assert values[0] <= values[1]
        page.click("#sort-metric")  # and back
        page.wait_for_url("**order=desc**")
        assert _metrics(page)[0] >= _metrics(page)[1]
        # the methods: each account's certified runs pooled; one seed each of the 3 a method needs, so none
        # is ranked yet, and the page names the test a method must pass to count as an improvement
        methods = page.locator("#methods tr.method").all_inner_texts()
        assert len(methods) == 2 and all("1 of 3" in m and "not ranked yet" in m for m in methods), methods
        assert "Welch's t-test" in page.inner_text("body")
        # the record history is drawn by the server, and the browser renders it
        # (wait_for_function polls through eval, which the pages' CSP refuses when it has to poll)
        page.eval_on_selector("#history-plot", "img => img.decode()")  # resolves once the image is in
        assert page.eval_on_selector("#history-plot", "img => img.naturalWidth") > 300
        # the recipe reads as a table, once opened
        page.click("#recipe-details summary")
        assert page.locator("#recipe").is_visible() and page.locator("#recipe tr").count() >= 3

        # open the best run: certified, with its plots drawn by the browser
        page.locator("#runs tr.run a").first.click()
        page.wait_for_selector("#loss-plot")
        assert page.inner_text("#status") == "certified"
        for plot in ("#loss-plot", "#optimizer-plot", "#fingerprint-plot"):
            page.eval_on_selector(plot, "img => img.decode()")
            assert page.eval_on_selector(plot, "img => img.naturalWidth") > 300
        best = int(page.url.rsplit("/", 1)[1])
        assert page.locator("#history tr.round").count() == (2 if best == ids["alice"] else 1)
        assert page.inner_text("#badge-snippet").startswith(f"[![witness]({url}/runs/")
        assert page.locator("#certification").count() == 1
        # the bound names what it is of; the re-audit command is on the page, for the file the link downloads
        assert page.inner_text("#bound") == "100 % against ≥ 5 % bad steps"
        assert page.get_by_role("link", name=f"run-{best}-submission.tar").count() == 1
        assert page.inner_text("#reaudit").startswith(f"mkdir -p run-{best} && tar -xf run-{best}-submission.tar -C "
                                                      f"run-{best} && witness verify run-{best}/bundle --mode offline ")
        # evaluation figures for reading: at most 4 significant digits
        for shown in page.locator("#evaluation td.agg").all_inner_texts():
            assert len(re.sub(r"[^0-9]", "", shown).lstrip("0")) <= 4, shown
        page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

        # alice's run: challenges split by when and by whom, never one sum
        page.goto(f"{url}/runs/{ids['alice']}")
        rows = page.locator("#challenge-counts tr.count").all_inner_texts()
        assert len(rows) == 2 and rows[0].split("\t")[:5] == ["at submission", "this server", "20", "20", "0"]
        assert re.match(r"later \(round \d+\)", rows[1].split("\t")[0]) and rows[1].split("\t")[1:5] == ["bob", "4", "4", "0"]
        # no cell is the sum (a clock time such as 17:28:24 may hold the digits: whole cells only)
        assert "24" not in [c for r in rows for c in r.split("\t")]
        # 20 steps that matched bit for bit are one line (inside the round's details), not 20 rows
        page.locator("#history details summary").first.click()
        assert page.locator("#history p.matched").first.inner_text() == "matched bit for bit: steps 0–19"

        # the online run: the steps replayed while it trained
        page.goto(f"{url}/runs/{ids['dave']}")
        live = page.inner_text("#online-live")
        assert re.fullmatch(r"([1-9]\d*) replayed and matched while it trained", live)
        assert f"{live.split()[0]} of them replayed while the run trained" in page.inner_text("#submission-replay")
        assert "--mode online --beacon-key " in page.inner_text("#reaudit")

        # the online run rejected while it trained: no work shown as pending, no command for a bundle it never sent
        page.goto(f"{url}/runs/{ids['eve']}")
        assert page.inner_text("#status") == "rejected"
        body = page.inner_text("body")
        assert "awaiting their state" not in body and "being replayed" not in body
        assert page.inner_text("#online-not-replayed") == "2 never replayed: the run was rejected first"
        assert page.locator("#reaudit").count() == 0 and "nothing to re-audit" in page.inner_text("#reaudit-none")

        # the rejected run is in its own section, not in the ranking; open mallory's
        page.goto(f"{url}/tracks/quick")
        rows = page.locator("#rejected tr.run")
        assert rows.count() == 1 and rows.first.get_attribute("data-status") == "rejected"
        assert page.locator(f"#runs a[href='/runs/{ids['mallory']}']").count() == 0
        rows.first.locator("a").first.click()
        page.wait_for_selector("#status")
        assert page.inner_text("#status") == "rejected"
        assert page.url.endswith(f"/runs/{ids['mallory']}")
        assert "replay" in page.inner_text("#reason")
        assert page.inner_text("#bound-line") == "Rejected: no bound."
        shares = [float(x) for x in re.findall(r"([0-9]+(?:\.[0-9]+)?) %", page.inner_text("body"))]
        assert shares and max(shares) <= 100
        browser.close()
