"""Ranking methods, not seeds (``witness.leaderboard.ranking``): Welch's test against a textbook example,
the record chain (a baseline, a significant improvement, a better mean that is not significant), the
seeds a method needs, and the track page's table of methods with each account's unsubmitted runs."""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
from lbhelpers import make_settings
from scipy import stats
from starlette.testclient import TestClient

from witness.leaderboard import views
from witness.leaderboard.app import create_app
from witness.leaderboard.db import Account, Run, Track
from witness.leaderboard.ranking import ALPHA, MethodEntry, Seed, rank_methods, welch_p
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track

# Welch's t-test, Wikipedia's first example: t = -2.46, nu = 24.9, two-sided p = 0.021
A1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
A2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]


def test_welchs_test_gives_the_textbook_figures():
    v1, v2 = statistics.variance(A1) / len(A1), statistics.variance(A2) / len(A2)
    t = (statistics.fmean(A1) - statistics.fmean(A2)) / math.sqrt(v1 + v2)
    nu = (v1 + v2) ** 2 / (v1**2 / (len(A1) - 1) + v2**2 / (len(A2) - 1))
    assert round(t, 2) == -2.46 and abs(nu - 24.9) < 0.15
    p = welch_p(A2, A1, higher_is_better=True)  # one-sided: A2's mean is the higher
    assert abs(2 * p - 0.021) < 0.001
    assert welch_p(A1, A2, higher_is_better=True) > 0.98  # the other way round
    assert welch_p(A1, A2, higher_is_better=False) == pytest.approx(p)  # lower is better: A1 beats A2
    assert welch_p([1.0], A1, True) == 1.0  # one seed: no spread to test with
    assert welch_p([2.0, 2.0], [1.0, 1.0], True) == 0.0 and welch_p([1.0, 1.0], [1.0, 1.0], True) == 1.0
    # one side with no spread (a method that scores the same on every seed): Welch's test is then the one-sample
    # test against that score, and it is exact, with no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = welch_p([0.70, 0.75, 0.81], [0.2578125] * 3, True)
    assert p == pytest.approx(stats.ttest_1samp([0.70, 0.75, 0.81], 0.2578125, alternative="greater").pvalue)


def _entry(name: str, values: list[float], first_ms: int) -> MethodEntry:
    return MethodEntry(name, [Seed(i, v, first_ms + i) for i, v in enumerate(values)])


def test_the_record_moves_only_on_a_significant_improvement():
    entries = [
        _entry("baseline", [0.70, 0.71, 0.69], 1000),
        _entry("lucky", [0.60, 0.80, 0.74], 2000),  # a better mean, but within the noise
        _entry("better", [0.80, 0.81, 0.805], 3000),  # clearly better than the baseline
        _entry("after", [0.79, 0.83, 0.815], 4000),  # better mean than "better", not significantly
        _entry("two-seeds", [0.99, 0.98], 500),  # the best mean, but not enough seeds to be ranked
    ]
    out = rank_methods(entries, higher_is_better=True, min_seeds=3)
    names = [e.method for e in out]
    assert names == ["after", "better", "lucky", "baseline", "two-seeds"]  # ranked by mean, then the waiting
    by = {e.method: e for e in out}
    assert by["baseline"].record and by["baseline"].verdict.startswith("baseline")
    assert not by["lucky"].record and by["lucky"].p_value > ALPHA and by["lucky"].against == "baseline"
    assert by["better"].record and by["better"].p_value < ALPHA and "improvement over baseline" in by["better"].verdict
    assert not by["after"].record and by["after"].against == "better"  # tested against the record of its time
    assert not by["two-seeds"].ranked and by["two-seeds"].p_value is None
    assert by["better"].mean == pytest.approx(0.805) and by["better"].spread == pytest.approx(0.005)


def test_lower_is_better_and_the_order_a_method_was_ranked_in():
    slow = _entry("slow", [2.0, 2.1, 1.9], 5000)
    fast = _entry("fast", [1.0, 1.05, 0.95], 9000)
    out = rank_methods([fast, slow], higher_is_better=False, min_seeds=3)
    assert [e.method for e in out] == ["fast", "slow"]
    assert out[1].record and out[1].verdict.startswith("baseline")  # ranked first in time: the baseline
    assert out[0].record and out[0].p_value < ALPHA


def test_the_track_page_ranks_methods_and_counts_unsubmitted_runs(tmp_path):
    lb = Leaderboard(make_settings("sqlite", tmp_path, tracks=(parse_track("quick=tiny:steps=20,seeds=3@accuracy+"),)))
    with lb.Session() as s:
        def account(name: str) -> Account:
            a = Account(name=name, public_key=name.ljust(64, "0"), token_hash=name.ljust(64, "1"), created_ms=0)
            s.add(a)
            s.flush()
            return a

        def run(a: Account, value: float | None, ms: int, status: str = "certified") -> None:
            s.add(Run(account_id=a.id, track="quick", r=f"{a.name}{ms}".ljust(64, "0"), status=status, ticket_ms=ms,
                      submitted_ms=ms if value is not None else None, decided_ms=ms if value is not None else None,
                      metric_value=value))

        alice, bob, carol = account("alice"), account("bob"), account("carol")
        for i, v in enumerate([0.70, 0.71, 0.69]):
            run(alice, v, 1000 + i)
        for i, v in enumerate([0.90, 0.91, 0.905]):
            run(bob, v, 2000 + i)
        for ms in (2100, 2200):
            run(bob, None, ms, status="ticketed")  # seeds bob started and never submitted
        run(carol, 0.99, 3000)
        s.commit()
    with TestClient(create_app(lb=lb)) as tc:
        page = tc.get("/tracks/quick").text
    table = page[page.index('id="methods"'):page.index("</table>", page.index('id="methods"'))]
    rows = table.split('<tr class="method')[1:]
    assert [next(n for n in ("alice", "bob", "carol") if f"<td>{n}</td>" in r) for r in rows] == ["bob", "alice", "carol"]
    assert "improvement over alice" in rows[0] and 'class="num unsubmitted">2<' in rows[0]
    assert "baseline" in rows[1] and "1 of 3" in rows[2] and "not ranked yet" in rows[2]
    assert "Welch&#39;s t-test" in page or "Welch's t-test" in page


def test_on_a_contest_track_seeds_tried_under_copies_of_a_method_show_beside_it(tmp_path):
    from witness.leaderboard.db import Method

    lb = Leaderboard(make_settings("sqlite", tmp_path, tracks=(parse_track("golf=tiny:max_steps=20,seeds=2@accuracy+"),)))
    with lb.Session() as s:
        a = Account(name="grinder", public_key="g".ljust(64, "0"), token_hash="g".ljust(64, "1"), created_ms=0)
        s.add(a)
        s.flush()
        methods = []
        for i in range(3):  # three copies of one method, files differing by a comment
            m = Method(account_id=a.id, track="golf", name=f"copy{i}", wheel_sha256=f"{i}" * 64, files_sha256=f"{i}" * 64,
                       distribution="m", version="1", task="m", config_json="{}", steps=20, batch_size=16, params=1,
                       created_ms=i)
            s.add(m)
            s.flush()
            methods.append(m)
        for j, (m, value) in enumerate([(methods[0], None), (methods[1], None), (methods[1], None),
                                        (methods[2], 0.9), (methods[2], 0.91)]):
            s.add(Run(account_id=a.id, track="golf", r=f"{j}".ljust(64, "0"), status="certified" if value else "ticketed",
                      ticket_ms=j, submitted_ms=j if value else None, decided_ms=j if value else None,
                      metric_value=value, method_id=m.id))
        s.commit()
        (entry,) = views.methods(s, s.get(Track, "golf"))
    assert entry.method == f"copy2 (#{methods[2].id}, grinder)" and entry.ranked
    assert entry.unsubmitted == 0 and entry.account_unsubmitted == 3 and entry.account_methods == 3
    with TestClient(create_app(lb=lb)) as tc:
        assert "account: 3 run(s), 3 method(s)" in tc.get("/tracks/golf").text
