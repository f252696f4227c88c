"""The cheap audit cannot be fooled: every attack a dishonest trainer (holding its own key) can mount
on the training state is caught, at the rate the verdict states.

Each attack builds a signed, well-formed bundle with the project's own recorder, and a response of
the trainer's own making; its only flaw is the dishonesty. Attacks on a fraction of the steps are
audited many times with a few challenges, and the detection rate is compared with the exact
(hypergeometric) value and with the bound 1 - (1 - f)^q that the verdict states.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import attacker_response, log_lines, resign, snapshot, train_tiny

from witness.bundle.checkpoint import read_checkpoint
from witness.bundle.reader import open_bundle
from witness.bundle.schema import HEAD_EXTENSION_FIELDS
from witness.bundle.state import load_state, state_hash, state_tensors
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.sorted_tree import SortedTree
from witness.data.order import derive_run_seed
from witness.errors import RunRejected, VerificationError
from witness.record.session import TrainingSession
from witness.task import build_task
from witness.verify import verify_bundle
from witness.verify.challenges import detection_probability, draw_challenges
from witness.verify.replay import DEFAULT_THRESHOLDS
from witness.verify.response import Response

ALL = 10_000  # challenge every step
STEPS = 40


def _audit_rate(bundle, response, bad: set[int], q: int, audits: int, **kw) -> None:
    """Audit ``audits`` times with ``q`` challenges. Every audit must reject exactly when it drew a
    bad step (naming only bad steps), and the rate must match the exact value and the bound."""
    opened, resp = open_bundle(bundle), Response(response)
    n = len(opened.steps)
    f = len(bad) / n
    caught = 0
    for seed in range(audits):
        nonce = seed.to_bytes(4, "big")
        drew_bad = any(c.step in bad for c in draw_challenges(opened.final_head, nonce, n, q))
        try:
            v = verify_bundle(opened, challenges=q, nonce=nonce, mode="interactive", response=resp,
                              bad_fraction=f, **kw)
        except RunRejected as e:
            failed = {r.step for r in e.verdict.results if not r.passed}
            assert drew_bad and failed and failed <= bad, (seed, e.failures)
            caught += 1
            continue
        assert not drew_bad, seed
        assert v.detection_probability == detection_probability(f, q)  # the bound the verdict states
    rate = caught / audits
    exact = 1 - math.comb(n - len(bad), q) / math.comb(n, q)
    bound = detection_probability(f, q)
    sigma = math.sqrt(exact * (1 - exact) / audits)
    assert exact >= bound
    assert abs(rate - exact) <= 4 * sigma, (rate, exact, bound)
    assert rate >= bound - 4 * sigma, (rate, bound)


def _interactive_all(bundle, response, **kw):
    """Challenge every step interactively; the rejection (RunRejected) or the verdict."""
    return verify_bundle(bundle, challenges=ALL, nonce=b"all", mode="interactive", response=response, **kw)


def _failed_steps(info) -> list[int]:
    return [r.step for r in info.value.verdict.results if not r.passed]


# --- 1. optimizer state forged so that the steps land on a fabricated trajectory ----------------

def _steer(rec, target: dict[str, torch.Tensor], lr: float, fraction: float = 0.2, scale: float = 1e6) -> None:
    """Forge AdamW's moments so that its next update (at learning rate ``lr``) moves every weight a
    ``fraction`` of the way to ``target``, whatever the batch's gradient says: m_hat / sqrt(v_hat)
    is set to (target - weight) * fraction / lr, with moments so large that the gradient is lost."""
    with torch.no_grad():
        for name, p in rec.model.named_parameters():
            st = rec.optimizer.state[p]
            k = float(st["step"]) + 1  # the step count the next update will use
            b1, b2 = 0.9, 0.95
            want = (target[f"model.{name}"] - p) * fraction / lr
            st["exp_avg"] = -want * scale * (1 - b1**k) / b1
            st["exp_avg_sq"] = torch.full_like(p, scale**2 * (1 - b2**k) / b2)


@pytest.fixture(scope="module")
def stolen(tmp_path_factory):
    """The final model of a stronger run from the same start (thrice the learning rate), trained elsewhere."""
    d = tmp_path_factory.mktemp("stolen")
    return _final(train_tiny(d / "other", config={"lr": 0.03}))


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
            _steer(rec, stolen, rec.lr(t))
        used[t] = snapshot(rec)  # the state this step really starts from
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if commit == "forged" and t + 1 < STEPS:
            _steer(rec, stolen, rec.lr(t + 1))
        return out

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    honest = train_tiny(tmp_path / "h")

    # The attack works against behavioural checks: the run lands near the stolen model, and every
    # step replayed from the state it really started from reproduces its record bit for bit.
    def dist(b):
        final = _final(b)
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
        verify_bundle(bundle, challenges=ALL)


# --- 2. a backdoor carried by optimizer state --------------------------------------------------

BACKDOOR_STEPS = {1, 4, 6, 9, 13, 16, 20, 23, 27, 30, 33, 37}  # 12 of 40 steps: f = 0.3


def _backdoor(rec) -> None:
    """Push a backdoor into AdamW's first moment: the next update moves the head toward it."""
    with torch.no_grad():
        for name, p in rec.model.named_parameters():
            if name.startswith("fc2"):
                rec.optimizer.state[p]["exp_avg"] += 0.05


@pytest.fixture(scope="module")
def backdoored(tmp_path_factory):
    d = tmp_path_factory.mktemp("backdoor")
    states: dict[int, dict] = {}

    def cheat(rec, t, batch):
        states[t] = snapshot(rec)
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t in BACKDOOR_STEPS:
            _backdoor(rec)  # committed with the state: the next step really starts from it
        return out

    bundle = train_tiny(d / "b", cheat=cheat)
    b = open_bundle(bundle)
    for t in range(1, STEPS):  # the trainer's states are the committed ones
        assert state_hash(states[t], b.manifest.state_digest) == b.committed_state(t)
    return bundle, attacker_response(bundle, d / "resp", states)


def test_a_backdoor_in_the_optimizer_state_is_caught_at_every_step_that_carries_it(backdoored):
    bundle, resp = backdoored
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp)
    assert set(_failed_steps(info)) == BACKDOOR_STEPS
    assert all("replayed training state does not hash to the committed one" in f for f in info.value.failures)


def test_a_backdoor_in_the_optimizer_state_is_caught_at_the_stated_rate(backdoored):
    bundle, resp = backdoored
    _audit_rate(bundle, resp, BACKDOOR_STEPS, q=3, audits=120)


# --- 3. parameters changed where neither the probes nor the sketch look ------------------------

GPT = {"n_layer": 1, "d_model": 32, "n_head": 2, "block": 32, "batch_size": 4, "probe_len": 8, "probes": 2,
       "corpus_max_bytes": 200_000, "warmup": 2, "steps": 12}
HIDDEN_STEPS = {3, 8}


def test_weights_the_probes_and_sketch_never_see_are_bound_by_the_state_hash(tmp_path):
    # tinygpt's position embeddings past the probes' length move no probe output; the sketch samples
    # a few of their coordinates only. The trainer writes into the others at two steps.
    states: dict[int, dict] = {}
    seen: dict[int, tuple] = {}

    def hidden(rec):
        c = rec.task.config
        positions, _ = rec.session.sketcher.plan({n: p.numel() for n, p in rec.model.named_parameters()})
        sampled = set(positions["pos.weight"][0].tolist())
        row = c.block - 1  # beyond probe_len: no probe reaches this position
        return [row * c.d_model + j for j in range(c.d_model) if row * c.d_model + j not in sampled]

    def cheat(rec, t, batch):
        states[t] = snapshot(rec)
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t in HIDDEN_STEPS:
            before = (rec.session.fingerprint().digest, rec.session.sketch())
            coords = torch.tensor(hidden(rec))
            with torch.no_grad():
                rec.model.pos.weight.view(-1)[coords] += 0.5
            seen[t] = (before, (rec.session.fingerprint().digest, rec.session.sketch()), len(coords))
        return out

    bundle = train_tiny(tmp_path / "b", task="tinygpt", config=GPT, checkpoint_every=4, cheat=cheat)
    for before, after, n in seen.values():
        assert before == after and n > 0  # invisible to the fingerprint digest and to the sketch
    resp = attacker_response(bundle, tmp_path / "resp", states)
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp)
    assert set(_failed_steps(info)) == HIDDEN_STEPS
    with pytest.raises(RunRejected) as info:
        verify_bundle(bundle, challenges=ALL)
    assert {int(f.split(":")[0].split()[1]) for f in info.value.failures} == HIDDEN_STEPS


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
        verify_bundle(bundle, challenges=ALL)
    v = info.value.verdict
    assert v.exact and not v.thresholds and all(not r.passed for r in v.results)


# --- 5. a null-space nudge under tolerance mode ------------------------------------------------

NUDGE_STEPS = {2, 7, 11, 15, 19, 24, 28, 33, 36, 38}  # 10 of 40: f = 0.25


class NullSpace:
    """Directions in the parameters that move, to first order, none of the fingerprint's numbers
    and none of the sketch's (which is linear): what tolerance mode used to compare."""

    def __init__(self, rec):
        self.task, self.model = rec.task, rec.model
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.sizes = [p.numel() for _, p in self.model.named_parameters()]
        n = sum(self.sizes)
        eye = torch.eye(n)
        self.sketch = torch.tensor([rec.session.sketcher(self._unflat(eye[i])) for i in range(n)]).T  # [k, n]

    def _unflat(self, flat):
        return {name: part.view(shape) for name, part, shape in
                zip(self.names, torch.split(flat, self.sizes), self.shapes, strict=True)}

    def nudge(self, rel: float, generator: torch.Generator) -> torch.Tensor:
        theta = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        probes = self.task.probe_tensors()
        self.task.fingerprint(self.model)  # builds the projection
        proj = self.task._proj

        def fp(flat):
            out = torch.func.functional_call(self.model, self._unflat(flat), (probes[0],))
            projected = (out.reshape(out.shape[0], -1, out.shape[-1]) @ proj).mean(dim=1).reshape(-1)
            return torch.cat([self.task.probe_losses(out, probes), projected])

        jac = torch.func.jacrev(fp)(theta)
        constraints = torch.cat([jac, self.sketch.to(jac.dtype)])
        _, _, vh = torch.linalg.svd(constraints.double(), full_matrices=True)
        null = vh[constraints.shape[0]:].T.float()  # orthogonal to every constraint row
        d = null @ torch.randn(null.shape[1], generator=generator)
        return d * (rel * theta.norm() / d.norm())


@pytest.fixture(scope="module")
def nudged(tmp_path_factory):
    d = tmp_path_factory.mktemp("nudge")
    states: dict[int, dict] = {}
    g = torch.Generator().manual_seed(3)
    space: list[NullSpace] = []

    def cheat(rec, t, batch):
        states[t] = snapshot(rec)
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t in NUDGE_STEPS:
            if not space:
                space.append(NullSpace(rec))
            delta = space[0].nudge(1e-3, g)
            with torch.no_grad():
                for p, part in zip(rec.model.parameters(), torch.split(delta, space[0].sizes), strict=True):
                    p.add_(part.view(p.shape))
        return out

    bundle = train_tiny(d / "b", cheat=cheat)
    states[STEPS] = _final(bundle)
    return bundle, attacker_response(bundle, d / "resp", states)


def _final(bundle) -> dict:
    return read_checkpoint(open_bundle(bundle).checkpoints[STEPS])


def test_a_null_space_nudge_passes_every_old_comparison_but_not_the_whole_state(nudged):
    bundle, resp = nudged
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp, exact=False)
    v = info.value.verdict
    assert {r.step for r in v.results if not r.passed} == NUDGE_STEPS
    for r in v.results:
        if not r.passed:  # only the whole parameter vector shows it
            assert all(r.distances[k] <= DEFAULT_THRESHOLDS[k] for k in ("loss", "fingerprint", "sketch", "update"))
            assert r.distances["parameters"] > 50 * DEFAULT_THRESHOLDS["parameters"]
            assert "parameters distance" in r.failure
    assert v.thresholds["parameters"] == DEFAULT_THRESHOLDS["parameters"]


def test_a_null_space_nudge_is_caught_at_the_stated_rate(nudged):
    bundle, resp = nudged
    _audit_rate(bundle, resp, NUDGE_STEPS, q=3, audits=100, exact=False)


# --- 6. used data left out of the end record ---------------------------------------------------

OMIT_STEPS = {0, 5, 9, 14, 18, 22, 27, 31, 35, 39}  # one sample of each: f = 0.25


@pytest.fixture(scope="module")
def omitted(tmp_path_factory, signing_key):
    d = tmp_path_factory.mktemp("omit")
    bundle = train_tiny(d / "b", signing_key)
    b = open_bundle(bundle)
    task = build_task("tiny", b.manifest.task_config)
    ds = task.dataset()
    hidden = {b.steps[t].batch[3] for t in OMIT_STEPS}
    assert all(sum(i in r.batch for r in b.steps) == 1 for i in hidden)  # each used by one step only
    kept = [i for r in b.steps for i in r.batch if i not in hidden]
    samples = SortedTree(ds.hashes[i] for i in kept)
    documents = SortedTree(ds.document_of(ds.sample_bytes(i)) for i in kept)
    lines = log_lines(bundle)
    end = parse_canonical_json(lines[-1])
    end["used_samples"] = {"root": samples.root.hex(), "size": samples.size}
    end["used_documents"] = {"root": documents.root.hex(), "size": documents.size}
    resign(bundle, signing_key, lines[:-1] + [canonical_json(end)])
    assert {k: end[k] for k in HEAD_EXTENSION_FIELDS} == open_bundle(bundle).final_head.extensions
    return bundle, attacker_response(bundle, d / "resp", _trainer_states(bundle), samples, documents)


def _trainer_states(bundle) -> dict[int, dict]:
    """Every committed state of an honest run, rebuilt by replaying its steps."""
    b = open_bundle(bundle)
    task = build_task(b.manifest.task, b.manifest.task_config)
    session = TrainingSession(task, b.manifest.run_seed, b.manifest.dataset_size)
    ds = task.dataset()
    def copy() -> dict:
        return {k: v.clone() for k, v in state_tensors(session.model, session.optimizer).items()}

    out = {0: copy()}
    for rec in b.steps:
        session.step(rec.step, [ds.sample_bytes(i) for i in rec.batch])
        out[rec.step + 1] = copy()
    return out


def test_used_data_left_out_is_caught_by_interactive_replay(omitted):
    bundle, resp = omitted
    with pytest.raises(RunRejected) as info:
        _interactive_all(bundle, resp)
    assert set(_failed_steps(info)) == OMIT_STEPS
    assert all("is not in the committed used-sample tree" in f for f in info.value.failures), info.value.failures[:2]
    with pytest.raises(VerificationError, match="data usage"):  # offline recomputes both trees in full
        verify_bundle(bundle, challenges=1)


def test_used_data_left_out_is_caught_at_the_stated_rate(omitted):
    bundle, resp = omitted
    _audit_rate(bundle, resp, OMIT_STEPS, q=3, audits=100)
