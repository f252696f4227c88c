"""The leaderboard's pages in real headless Chromium (Debian's package), driven by Playwright."""

from __future__ import annotations

import shutil

import httpx
import pytest
from lbhelpers import make_settings, register, submit, train_and_certify
from playwright.sync_api import sync_playwright

from witness.leaderboard.demo import start_server
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.worker import work

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium as root in a sandbox-less container, with no background traffic to a closed network
# (Playwright adds --headless and a fresh profile of its own).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A server with two certified runs and one rejected run."""
    tmp = tmp_path_factory.mktemp("site")
    lb = Leaderboard(make_settings("sqlite", tmp))
    server, thread, url = start_server(lb, port=0)
    ids = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for name, cheat in (("alice", None), ("bob", None), ("mallory", {s: 2.0 for s in range(5, 15)})):
            t = register(c, name)
            run_id, bundle, cert = train_and_certify(c, t, tmp / name, lr_cheat=cheat)
            submit(c, t, bundle, cert)
            ids[name] = run_id
    work(lb, once=True)
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
        page = browser.new_page()
        page.goto(url + "/")
        page.get_by_role("link", name="quick").click()
        page.wait_for_selector("#runs")
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
        # the record history is drawn by the server, and the browser renders it
        # (wait_for_function polls through eval, which the pages' CSP refuses when it has to poll)
        page.eval_on_selector("#history-plot", "img => img.decode()")  # resolves once the image is in
        assert page.eval_on_selector("#history-plot", "img => img.naturalWidth") > 300
        # the recipe reads as a table
        assert page.locator("#recipe tr").count() >= 3

        # open the best run: certified, with its plots drawn by the browser
        page.locator("#runs tr.run a").first.click()
        page.wait_for_selector("#loss-plot")
        assert page.inner_text("#status") == "certified"
        for plot in ("#loss-plot", "#optimizer-plot", "#fingerprint-plot"):
            page.eval_on_selector(plot, "img => img.decode()")
            assert page.eval_on_selector(plot, "img => img.naturalWidth") > 300
        assert page.locator("#history tr.round").count() == 1
        assert page.inner_text("#badge-snippet").startswith(f"[![witness]({url}/runs/")
        assert page.locator("#certification").count() == 1
        page.screenshot(path=str(tmp_path / "run.png"), full_page=True)

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
        browser.close()
