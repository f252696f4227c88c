"""Ranking methods, not seeds: each method's certified seeds pooled, a mean and a spread, and a method
marked as an improvement only where it beats the record of its time at p < 0.01.

On a track of one registered recipe, an account's runs are its method (they differ by their seeds only);
on a track that fixes the contest and not the recipe, a method is its pinned code. Either way a method
enters the ranking with ``min_seeds`` certified runs. The record starts with the first method ranked
(the track's baseline); a later method with a better mean becomes the record only if Welch's t-test
(one-sided, unequal variances, over certified seeds only) gives p < ``ALPHA`` against it. Runs the
method's account started and never submitted are counted beside it: a seed ground until one passes is
visible there.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy import stats

ALPHA = 0.01
TEST = "Welch's t-test (one-sided, unequal variances) over certified seeds"


@dataclass(frozen=True)
class Seed:
    """One certified run of a method: its metric and when it was certified."""

    run_id: int
    value: float
    decided_ms: int


@dataclass
class MethodEntry:
    """A method on a track: its certified seeds and what the ranking says of it."""

    method: str
    seeds: list[Seed]
    unsubmitted: int = 0  # runs its account started and never submitted, or saw rejected or revoked
    # on a contest track, what its account did with all its methods there: runs started and never submitted,
    # and methods admitted (a copy of a method is another method, whose seeds are counted apart)
    account_unsubmitted: int | None = None
    account_methods: int | None = None
    ranked: bool = False
    mean: float = math.nan
    spread: float = math.nan  # the sample standard deviation (0 for one seed)
    ranked_ms: int | None = None  # when its min_seeds-th seed was certified
    record: bool = False  # the record when it was ranked: the baseline, or a significant improvement
    against: str | None = None  # the record it was tested against
    p_value: float | None = None
    verdict: str = ""
    history: list[str] = field(default_factory=list)


def welch_p(better: Sequence[float], worse: Sequence[float], higher_is_better: bool) -> float:
    """The p-value of Welch's one-sided t-test that ``better``'s mean beats ``worse``'s (1 where it cannot
    be told: fewer than two seeds on a side, or no spread at all and no difference)."""
    if len(better) < 2 or len(worse) < 2:
        return 1.0
    if statistics.pvariance(better) == 0 and statistics.pvariance(worse) == 0:
        # t is infinite (or undefined): a difference with no spread is certain, none is not one
        gain = statistics.fmean(better) - statistics.fmean(worse)
        return 0.0 if (gain > 0 if higher_is_better else gain < 0) else 1.0
    with warnings.catch_warnings():
        # one side with no spread (a method that scores the same on every seed) is exact, not a loss of
        # precision: scipy warns of one all the same, and its variance is still exactly zero
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        result = stats.ttest_ind(better, worse, equal_var=False, alternative="greater" if higher_is_better else "less")
    p = float(result.pvalue)
    return 1.0 if math.isnan(p) else p


def rank_methods(entries: list[MethodEntry], higher_is_better: bool, min_seeds: int) -> list[MethodEntry]:
    """Every method's mean and spread, which are ranked, and the record chain in the order they were
    ranked; returned best first (ranked ones), then the others."""
    for e in entries:
        values = [s.value for s in e.seeds]
        e.ranked = len(values) >= min_seeds
        if values:
            e.mean = statistics.fmean(values)
            e.spread = statistics.stdev(values) if len(values) > 1 else 0.0
        if e.ranked:
            e.ranked_ms = sorted(s.decided_ms for s in e.seeds)[min_seeds - 1]
    record: MethodEntry | None = None
    for e in sorted((e for e in entries if e.ranked), key=lambda e: (e.ranked_ms, e.method)):
        if record is None:
            e.record, e.verdict = True, "baseline: the first method ranked"
            record = e
            continue
        e.against = record.method
        e.p_value = welch_p([s.value for s in e.seeds], [s.value for s in record.seeds], higher_is_better)
        if e.p_value < ALPHA:
            e.record, e.verdict = True, f"improvement over {record.method} (p = {e.p_value:.2g} < {ALPHA})"
            record = e
        else:
            e.verdict = f"not a significant improvement over {record.method} (p = {e.p_value:.2g})"
    sign = -1.0 if higher_is_better else 1.0
    ranked = sorted((e for e in entries if e.ranked), key=lambda e: (sign * e.mean, e.method))
    waiting = sorted((e for e in entries if not e.ranked), key=lambda e: (-len(e.seeds), e.method))
    return ranked + waiting
