"""Detection rate over repeated audits matches the bound 1-(1-f)^q (fixed seeds, real audits)."""

from __future__ import annotations

import math

import pytest
from helpers import assert_binomial, train_tiny

from witness.errors import RunRejected
from witness.verify import Policy, Verifier
from witness.verify.challenges import challenges_needed, detection_probability, draw_challenges

STEPS, BAD = 20, {2, 9, 13, 17}  # f = 0.2


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    def cheat(rec, t, batch):
        if t in BAD:
            ds = rec.task.dataset()
            other = rec.task.collate([ds.sample_bytes((i + 1) % len(ds)) for i in rec.batch_indices(t)])
            return rec.task.train_step(rec.model, rec.optimizer, other, rec.lr(t), rec.step_seed(t))
        return None

    # A checkpoint at every step: each challenge replays exactly its own step.
    return train_tiny(tmp_path_factory.mktemp("bad") / "b", config={"steps": STEPS}, checkpoint_every=1, cheat=cheat)


def _hypergeometric_detection(n: int, bad: int, q: int) -> float:
    """Exact detection probability when q distinct steps are drawn from n (without replacement)."""
    return 1 - math.comb(n - bad, q) / math.comb(n, q)


@pytest.mark.parametrize("q", [1, 3])
def test_detection_rate_matches_the_bound(bad_run, q):
    from witness.bundle.reader import open_bundle

    audits = 150
    caught = 0
    bundle = open_bundle(bad_run)  # read and authenticated once; every audit then checks and replays it
    for seed in range(audits):
        drew_bad = any(c.step in BAD for c in draw_challenges(bundle.final_head, seed.to_bytes(4, "big"), STEPS, q))
        try:
            Verifier(policy=Policy(challenges=q, nonce=seed.to_bytes(4, "big"))).verify(bundle)
        except RunRejected as e:
            assert drew_bad and all(int(f.split(":")[0].split()[1]) in BAD for f in e.failures)
            caught += 1
            continue
        assert not drew_bad, seed
    exact = _hypergeometric_detection(STEPS, len(BAD), q)
    # Drawing without replacement is never worse than the bound; the rate sits on the exact value.
    assert exact >= detection_probability(len(BAD) / STEPS, q) - 1e-12
    assert_binomial(caught, audits, exact)


@pytest.mark.parametrize("n, bad, q", [(40, 12, 3), (20, 4, 1), (1000, 50, 90)])
def test_the_draw_hits_a_bad_set_at_the_exact_rate(honest_bundle, n, bad, q):
    # Many more draws than the real audits can afford: the rate is pinned to within about 2 %.
    from witness.bundle.reader import open_bundle

    head = open_bundle(honest_bundle).final_head
    bad_steps = {i * n // bad for i in range(bad)}  # spread over the run
    assert len(bad_steps) == bad
    draws = 20_000 if q < 10 else 2_000
    hits = sum(any(c.step in bad_steps for c in draw_challenges(head, i.to_bytes(4, "big"), n, q))
               for i in range(draws))
    assert_binomial(hits, draws, _hypergeometric_detection(n, bad, q))


def test_challenges_are_uniform_and_depend_on_head_and_nonce(honest_bundle):
    from witness.bundle.reader import open_bundle

    head = open_bundle(honest_bundle).final_head
    counts = [0] * 40
    for seed in range(2000):
        for ch in draw_challenges(head, seed.to_bytes(4, "big"), 40, 2):
            counts[ch.step] += 1
    expected = 2000 * 2 / 40
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 118  # 39 degrees of freedom: p < 1e-9 unless the draw is biased (Wilson-Hilferty)
    a = draw_challenges(head, b"a", 40, 5)
    assert a == draw_challenges(head, b"a", 40, 5)
    assert a != draw_challenges(head, b"b", 40, 5)


def test_challenges_needed():
    assert challenges_needed(0.99, 0.05) == 90
    assert detection_probability(0.05, 90) >= 0.99 > detection_probability(0.05, 89)
    assert challenges_needed(0.5, 0.5) == 1
    # challenges are distinct steps: covering every step leaves no bad step unseen
    assert detection_probability(0.05, 40, steps=40) == 1.0
    assert detection_probability(0.05, 39, steps=40) == pytest.approx(1 - 0.95**39)


def test_a_failed_segment_replayed_again_counts_its_steps_once_and_its_bound_rounds_down(tmp_path):
    """Each later challenge in a failed segment replays it again: compute, not more evidence. The
    verdict counts the steps replayed once each, says how many replays that took, and shows no bound
    rounded up."""
    import pytest
    import torch
    from helpers import train_tiny

    from witness.errors import RunRejected
    from witness.verify import Policy, Verifier
    from witness.verify.verdict import percent_down

    def cheat(rec, t, batch):
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t == 3:
            with torch.no_grad():
                next(rec.model.parameters()).view(-1)[0] += 0.5
        return out

    bundle = train_tiny(tmp_path / "b", config={"steps": 8}, checkpoint_every=8, state_every=8, cheat=cheat)
    with pytest.raises(RunRejected) as caught:
        Verifier(policy=Policy(mode="offline", challenges=8)).verify(bundle)
    v = caught.value.verdict
    assert v.distinct_steps <= 8 < v.replayed_steps  # the segment of steps 0..7 was replayed more than once
    assert f"{v.distinct_steps} distinct step(s) replayed ({v.replayed_steps} replays of them)" in v.summary()
    assert percent_down(0.99996) == "99.99" and percent_down(0.99) == "99.00" and percent_down(1.0) == "100.00"
