"""The cheap audit cannot be fooled: every attack a dishonest trainer (holding its own key) can mount
on the training state is caught, at the rate the verdict states.

Each attack builds a signed, well-formed bundle with the project's own recorder, and a response of
the trainer's own making; its only flaw is the dishonesty. Attacks on a fraction of the steps are
audited many times with a few challenges, and the detection rate is compared with the exact
(hypergeometric) value and with the bound 1 - (1 - f)^q that the verdict states.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from attacks import build, final_state, steer
from helpers import assert_binomial, attacker_response, snapshot, train_tiny

from witness.bundle.reader import open_bundle
from witness.bundle.state import load_state
from witness.data.order import derive_run_seed
from witness.errors import RunRejected, VerificationError
from witness.session import TrainingSession
from witness.task import build_task
from witness.verify import Evidence, Policy, Verifier
from witness.verify.challenges import detection_probability, draw_challenges
from witness.verify.replay import DEFAULT_THRESHOLDS
from witness.verify.response import Response

ALL = 10_000  # challenge every step
STEPS = 40


def _audit_rate(bundle, response, bad: set[int], q: int, audits: int, **kw) -> None:
    """Audit ``audits`` times with ``q`` challenges. Every audit must reject exactly when it drew a
    bad step (naming only bad steps), and the rate must match the exact (hypergeometric) value. The
    draw itself is tested with many more draws in test_statistics."""
    opened, resp = open_bundle(bundle), Response(response)
    n = len(opened.steps)
    f = len(bad) / n
    caught = 0
    for seed in range(audits):
        nonce = seed.to_bytes(4, "big")
        drew_bad = any(c.step in bad for c in draw_challenges(opened.final_head, nonce, n, q))
        try:
            v = Verifier(policy=Policy(challenges=q, nonce=nonce, mode="interactive", bad_fraction=f, **kw)).verify(
                opened, Evidence(response=resp))
        except RunRejected as e:
            failed = {r.step for r in e.verdict.results if not r.passed}
            assert drew_bad and failed and failed <= bad, (seed, e.failures)
            caught += 1
            continue
        assert not drew_bad, seed
        assert v.detection_probability == detection_probability(f, q)  # the bound the verdict states
    exact = 1 - math.comb(n - len(bad), q) / math.comb(n, q)
    assert exact >= detection_probability(f, q)  # drawing without replacement beats the stated bound
    assert_binomial(caught, audits, exact)


def _interactive_all(bundle, response, **kw):
    """Challenge every step interactively; the rejection (RunRejected) or the verdict."""
    policy = Policy(challenges=ALL, nonce=b"all", mode="interactive", **kw)
    return Verifier(policy=policy).verify(bundle, Evidence(response=response))


def _failed_steps(info) -> list[int]:
    return [r.step for r in info.value.verdict.results if not r.passed]


# --- 1. optimizer state forged so that the steps land on a fabricated trajectory ----------------

@pytest.fixture(scope="module")
def stolen(tmp_path_factory):
    """The final model of a stronger run from the same start (thrice the learning rate), trained elsewhere."""
    d = tmp_path_factory.mktemp("stolen")
    return final_state(train_tiny(d / "other", config={"lr": 0.03}))


@pytest.mark.parametrize("commit", ["honest", "forged"])
def test_forged_optimizer_state_cannot_carry_a_stolen_model(tmp_path, stolen, commit):
    # The trainer steers its run onto a stolen model through forged optimizer moments. With
    # commit="honest" it commits the states its steps produced and forges the moments just before
    # the next step; with "forged" it forges them right after a step, so the forged states are the
    # ones it commits.
    committed: dict[int, dict] = {}
    used: dict[int, dict] = {}

    def cheat(rec, t, batch):
        committed[t] = snapshot(rec)
        if t > 0 and commit == "honest":
            steer(rec, stolen, rec.lr(t))
        used[t] = snapshot(rec)  # the state this step really starts from
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if commit == "forged" and t + 1 < STEPS:
            steer(rec, stolen, rec.lr(t + 1))
        return out

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    honest = train_tiny(tmp_path / "h")

    # The attack works against behavioural checks: the run lands near the stolen model, and every
    # step replayed from the state it really started from reproduces its record bit for bit.
    def dist(b):
        final = final_state(b)
        return sum(float((final[k] - stolen[k]).norm() ** 2) for k in stolen if k.startswith("model.")) ** 0.5

    assert dist(bundle) < 0.1 * dist(honest), (dist(bundle), dist(honest))
    b = open_bundle(bundle)
    task = build_task("tiny", b.manifest.task_config)
    session = TrainingSession(task, b.manifest.run_seed, b.manifest.dataset_size)
    ds = task.dataset()
    for t in (3, 17, 39):
        load_state(session.model, session.optimizer, used[t])
        session.step(t, [ds.sample_bytes(i) for i in b.steps[t].batch])
        assert session.fingerprint().digest == b.steps[t].digest.hex()
        assert tuple(session.sketch()) == b.steps[t].sketch

    # The whole-state commitment catches it at every step it steered: the states it really used do
    # not hash to what it committed, or the committed ones do not replay onto its trajectory.
    first, last = (1, STEPS) if commit == "honest" else (0, STEPS - 1)
    for name, states in (("used", used), ("committed", committed)):
        resp = attacker_response(bundle, tmp_path / f"resp_{name}", states)
        with pytest.raises(RunRejected) as info:
            _interactive_all(bundle, resp)
        assert _failed_steps(info) == list(range(first, last)), name
        # (a challenge may also go on from the state the previous one reached, which is committed)
        why = ("does not hash to the committed state", "replayed behavioral fingerprint differs",
               "replayed training state does not hash to the committed one")
        assert all(any(w in f for w in why) for f in info.value.failures), info.value.failures[:2]
    with pytest.raises(RunRejected):  # offline replay rejects it too
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)


# --- 3. parameters changed where neither the probes nor the sketch look ------------------------

HIDDEN_STEPS = {3, 8}


def test_weights_the_probes_and_sketch_never_see_are_bound_by_the_state_hash(tmp_path):
    # tinygpt's last position embedding moves no probe output, and the sketch samples a few of its
    # coordinates only: the trainer writes into the others at two steps.
    bundle, resp, _ = build("hidden", tmp_path, HIDDEN_STEPS, 12)
    b = open_bundle(bundle)
    task = build_task("tinygpt", b.manifest.task_config)
    session = TrainingSession(task, b.manifest.run_seed, b.manifest.dataset_size)
    ds = task.dataset()
    for t in sorted(HIDDEN_STEPS):  # invisible: the honest step gives the recorded fingerprint and sketch
        load_state(session.model, session.optimizer, Response(resp).state(t))
        session.step(t, [ds.sample_bytes(i) for i in b.steps[t].batch])
        assert session.fingerprint().digest == b.steps[t].digest.hex()
        assert tuple(session.sketch()) == b.steps[t].sketch
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp)
    assert set(_failed_steps(info)) == HIDDEN_STEPS
    with pytest.raises(RunRejected) as info:  # offline, every replay from checkpoint 0 meets step 3 first
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    assert info.value.failures[0].startswith("step 3: replay: the replayed training state does not hash")
    assert _failed_steps(info) == list(range(3, 10))


# --- 4. a claimed world size that would buy tolerance mode -------------------------------------

def test_a_claimed_world_size_buys_no_tolerance(tmp_path):
    # A single-process run whose signed manifest claims four DDP ranks: the verifier still replays
    # bit for bit (over four micro-batches, as four ranks would have computed), so every step fails.
    task = build_task("tiny", {"steps": 12})
    seed = derive_run_seed(task.dataset().root, b"\x07" * 32)
    claim = TrainingSession(task, seed, len(task.dataset()), world_size=4, parallelism="ddp")

    def cheat(rec, t, batch):  # what it really computes: one process, one batch
        return rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))

    bundle = train_tiny(tmp_path / "b", config={"steps": 12}, session=claim, cheat=cheat)
    assert open_bundle(bundle).manifest.world_size == 4
    with pytest.raises(RunRejected) as info:
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    v = info.value.verdict
    assert v.exact and not v.thresholds and all(not r.passed for r in v.results)


# --- 2, 5, 6. attacks on a fraction of the steps: caught at every bad step, at the stated rate --

SAMPLED = {
    # a backdoor carried by AdamW's first moment, at 12 of 40 steps (f = 0.3)
    "backdoor": ({1, 4, 6, 9, 13, 16, 20, 23, 27, 30, 33, 37},
                 "replayed training state does not hash to the committed one"),
    # a nudge in the null space of the fingerprint and the sketch, under tolerance mode (f = 0.25)
    "nudge": ({2, 7, 11, 15, 19, 24, 28, 33, 36, 38}, "parameters distance"),
}


@pytest.fixture(scope="module", params=sorted(SAMPLED))
def sampled(request, tmp_path_factory):
    kind = request.param
    bundle, resp, options = build(kind, tmp_path_factory.mktemp(kind), SAMPLED[kind][0], STEPS)
    return kind, bundle, resp, options


def test_a_sampled_attack_is_caught_at_every_step_that_carries_it(sampled):
    kind, bundle, resp, options = sampled
    bad, why = SAMPLED[kind]
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp, **options)
    v = info.value.verdict
    assert set(_failed_steps(info)) == bad
    assert all(why in f for f in info.value.failures), info.value.failures[:2]
    if kind == "nudge":  # it passes every comparison tolerance mode used to make: only the whole state shows it
        assert options == {"exact": False} and v.thresholds["parameters"] == DEFAULT_THRESHOLDS["parameters"]
        for r in v.results:
            if not r.passed:
                assert all(r.distances[k] <= DEFAULT_THRESHOLDS[k] for k in ("loss", "fingerprint", "sketch", "update"))
                assert r.distances["parameters"] > 50 * DEFAULT_THRESHOLDS["parameters"]


def test_used_data_left_out_of_the_end_record_is_caught_in_full_whatever_is_drawn(tmp_path):
    # One sample of each of 10 steps left out of the used-data trees (f = 0.25). It used to be caught
    # only where a challenge replayed such a step; the trees are now rebuilt from the dataset's
    # committed leaves in every mode, before any replay: every audit rejects it, offline and cheap.
    omitted = {0, 5, 9, 14, 18, 22, 27, 31, 35, 39}
    bundle, resp, _ = build("omit", tmp_path, omitted, STEPS)
    opened = open_bundle(bundle)
    clean = next(n.to_bytes(2, "big") for n in range(999)
                 if not {c.step for c in draw_challenges(opened.final_head, n.to_bytes(2, "big"), STEPS, 1)} & omitted)
    for nonce in (clean, b"a", b"b"):
        for mode in ("offline", "interactive"):
            with pytest.raises(VerificationError, match="used-sample tree .* leaves out data the run trained on") as info:
                Verifier(policy=Policy(challenges=1, nonce=nonce, mode=mode)).verify(opened, Evidence(response=resp))
            assert not isinstance(info.value, RunRejected)  # no replay was needed


def test_a_sampled_attack_is_caught_at_the_stated_rate(sampled):
    kind, bundle, resp, options = sampled
    _audit_rate(bundle, resp, SAMPLED[kind][0], q=3, audits=100, **options)


# --- what witness respond ships --------------------------------------------------------------

@pytest.mark.parametrize("tolerance", [False, True])
def test_respond_ships_exactly_the_states_the_audit_reads(tmp_path, monkeypatch, tolerance):
    from witness.verify.respond import respond

    bundle = train_tiny(tmp_path / "run", config={"steps": 30}, checkpoint_every=10)
    respond(bundle, tmp_path / "resp", nonce=b"n", challenges=20, tolerance=tolerance)
    shipped = {int(k) for k in json.loads((tmp_path / "resp" / "response.json").read_bytes())["states"]}
    read: list[int] = []
    state = Response.state
    monkeypatch.setattr(Response, "state", lambda self, step: (read.append(step), state(self, step))[1])
    v = Verifier(policy=Policy(challenges=20, nonce=b"n", mode="interactive", exact=not tolerance)).verify(bundle, Evidence(response=tmp_path / "resp"))
    assert v.accepted and set(read) == shipped
    if not tolerance:  # 20 of 30 steps: runs of consecutive challenges replay on from their own states
        assert len(shipped) < 20
    else:
        assert len(shipped) > 20  # each segment's start and end


def test_a_bad_step_answered_by_witness_respond_is_rejected_not_unusable(tmp_path):
    from witness.verify.respond import respond

    def cheat(rec, t, batch):
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t == 4:
            with torch.no_grad():
                next(rec.model.parameters()).add_(0.01)
        return out

    bundle = train_tiny(tmp_path / "run", config={"steps": 12}, checkpoint_every=6, cheat=cheat)
    respond(bundle, tmp_path / "resp", nonce=b"all", challenges=ALL)
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, tmp_path / "resp")
    assert _failed_steps(info)[0] == 4 and len(info.value.failures) == 1  # the next ones could not start: noted
    assert any("not replayed: an earlier segment failed" in (r.failure or "") for r in info.value.verdict.results)
