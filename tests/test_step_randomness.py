"""Every step's randomness is the committed step seed: a model that draws from torch's global
generator (``nn.Dropout``, SDPA's ``dropout_p``) or Python's or NumPy's replays bit for bit, and
the caller's own streams go on as if the step had drawn nothing."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from witness.cli import main
from witness.task import registry
from witness.task.base import step_randomness

PLUGIN = '''"""A plugin task whose model draws dropout masks from torch's global generator."""

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from witness.task.generic import GenericTask


class Noisy(nn.Module):
    """Dropout as people write it: nn.Dropout, SDPA's dropout_p, and a little noise from Python's
    and NumPy's global generators."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.drop(torch.relu(self.inp(x)))
        q = h.view(-1, 1, 2, 4)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3 if self.training else 0.0).reshape(-1, 8)
        if self.training:
            h = h * (1 + 0.01 * random.random()) * float(1 + 0.01 * np.random.rand())
        return self.out(h)


class DropoutTask(GenericTask):
    """Two-class toy data through the noisy model."""

    name = "dropout-test"

    def make_model(self):
        return Noisy()

    def make_dataset(self):
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(4, generator=g), "y": torch.tensor(i % 2)} for i in range(64)]
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """The plugin, installed on a path the registry sees."""
    path = tmp_path / "site"
    pkg = path / "witness_dropout_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    info = path / "witness_dropout_demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: witness-dropout-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[witness.tasks]\ndropout-test = witness_dropout_demo:DropoutTask\n")
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("witness_dropout_demo", None)
    registry._built.cache_clear()


def test_a_step_that_draws_global_randomness_repeats_bit_for_bit(site):
    task = registry.build_task("dropout-test", {"steps": 4, "batch_size": 8})
    batch = task.collate([task.dataset().sample_bytes(i) for i in range(8)])

    def step(seed: int) -> tuple[float, list[torch.Tensor]]:
        model = task.build_model(b"\x01" * 32)
        opt = task.build_optimizer(model)
        out = task.train_step(model, opt, batch, 0.1, seed)
        return out.loss, [p.detach().clone() for p in model.parameters()]

    runs = [step(7) for _ in range(5)]
    assert len({loss for loss, _ in runs}) == 1  # before: five different losses
    assert all(torch.equal(a, b) for _, ps in runs[1:] for a, b in zip(runs[0][1], ps, strict=True))
    assert step(8)[0] != runs[0][0]  # another step seed, other masks


def test_the_callers_own_streams_go_on_as_if_the_step_drew_nothing():
    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with step_randomness(123):
        inside = draws()
    assert draws() == want
    with step_randomness(123):
        assert draws() == inside  # the block's draws are a function of the seed alone
    with step_randomness(124):
        assert draws() != inside


def test_a_run_with_global_dropout_is_recorded_and_verified_exactly(site, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "dropout-test", "--steps", "8", "--checkpoint-every", "4", "--quiet",
                 "--config", "batch_size=8", "--key", str(tmp_path / "k.pem"), "--out", str(out)]) == 0
    capsys.readouterr()
    for extra in ([], ["--tolerance"]):
        assert main(["verify", "--allow-weak", str(out), "--challenges", "8", "--json", *extra]) == 0, capsys.readouterr().err
        capsys.readouterr()
    assert main(["verify", "--allow-weak", str(out), "--mode", "offline", "--challenges", "8"]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


# --- the record-time self-check ---------------------------------------------------------------

def _loop(task, out, *, loss_of=None, lr_scale=1.0, report=float, self_check=True, log_lr=None, factor=None):
    """A user's own loop around the recorder: its step, its loss, its learning rate."""
    from witness.commit.signing import generate_key
    from witness.record import Commitments, Recorder, SelfChecking
    from witness.task.base import StepOutput, clip_whole, mean_of_ranks, micro_seed

    rec = Recorder.create(task, out, generate_key(), r=b"\x09" * 32, commit=Commitments(checkpoint_every=4),
                          self_check=SelfChecking(enabled=self_check))
    for t in range(task.config.steps):
        batch = rec.batch(t)
        for g in rec.optimizer.param_groups:
            g["lr"] = rec.lr(t) * lr_scale
        rec.optimizer.zero_grad(set_to_none=True)
        rec.model.train()
        if task.grad_accum == 1:
            loss = (loss_of or (lambda m, b, t: task.step_loss(m, b, rec.step_seed(t))))(rec.model, batch, t)
            loss.backward()
            value = float(loss.detach())
        else:  # nanoGPT's idiom: loss / gradient_accumulation_steps, backward per micro-batch
            losses = []
            for k, micro in enumerate(task.split_batch(batch, task.grad_accum)):
                loss = task.step_loss(rec.model, micro, micro_seed(rec.step_seed(t), k))
                (loss / task.grad_accum * (factor() if factor else 1.0)).backward()
                losses.append(float(loss.detach()))
            value = mean_of_ranks(losses)
        gn = clip_whole([p for p in rec.model.parameters() if p.grad is not None], task.config.grad_clip)
        rec.optimizer.step()
        rec.log_step(t, StepOutput(report(value), (log_lr or rec.lr)(t), float(gn)))
    rec.finish()
    return rec


def test_an_honest_own_loop_passes_the_self_check_and_says_what_it_cost(site, tmp_path, capsys):
    task = registry.build_task("dropout-test", {"steps": 6, "batch_size": 8})
    rec = _loop(task, tmp_path / "run")
    r = rec.self_check.report()
    assert r["steps"][0] == 0 and len(r["steps"]) == 2 and 1 <= r["steps"][1] <= 5 and r["seconds"] > 0
    # the loop says so, in one line, when it finishes
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"self-check: step(s) 0 and {r['steps'][1]} ")


@pytest.mark.parametrize("flaw, message", [
    ({"loss_of": lambda m, b, t: _task().loss(m, b, None)},
     "drew from torch's global, Python's random, NumPy's global generator outside the step's randomness"),
    ({"report": lambda v: 2.0 * v}, "your loop's loss is"),
    ({"report": lambda v: float(np.nextafter(np.float32(v), np.float32(np.inf)))}, r"\(1 float32 ulp\(s\) apart\)"),
    ({"lr_scale": 1.01}, "although the loss and gradient norm match; the update is not the task's"),
])
def test_a_loop_that_would_not_replay_stops_at_step_0_and_says_why(site, tmp_path, flaw, message):
    from witness.record.selfcheck import SelfCheckFailed

    with pytest.raises(SelfCheckFailed, match=message) as e:
        _loop(_task(), tmp_path / "run", **flaw)
    assert str(e.value).startswith("step 0 does not replay")
    assert (tmp_path / "run" / "log.jsonl").read_bytes().count(b"\n") == 1  # nothing past the manifest signed
    # the same loop without the check records a run that the verifier then rejects
    _loop(_task(), tmp_path / "unchecked", self_check=False, **flaw)
    assert main(["verify", "--allow-weak", str(tmp_path / "unchecked"), "--challenges", "6", "--json"]) == 1


@pytest.mark.parametrize("flaw, config, message", [
    # a rate of its own, logged: named as the rate, not as a parameter difference
    ({"lr_scale": 1.01, "log_lr": "scaled"}, {}, "the learning rate is not the schedule's: your loop logged"),
    # a rate of its own, not logged: the parameter difference, with the rate the optimizer held
    ({"lr_scale": 1.01}, {}, "the optimizer's parameter groups hold the learning rate"),
    # a random factor on the loss in an accumulation loop: an accumulation hint, not one backward's
    ({"factor": lambda: 1.0 + random.random()}, {"grad_accum": 2},
     "after 2 backward passes, one per micro-batch"),
])
def test_a_self_check_message_names_the_real_cause(site, tmp_path, flaw, config, message):
    from witness.record.selfcheck import SelfCheckFailed

    task = registry.build_task("dropout-test", {"steps": 6, "batch_size": 8, **config})
    if flaw.get("log_lr") == "scaled":
        flaw = {**flaw, "log_lr": lambda t: task.schedule.at(t) * 1.01}
    with pytest.raises(SelfCheckFailed, match=message) as e:
        _loop(task, tmp_path / "run", **flaw)
    assert "after one backward over the whole batch" not in str(e.value)


def test_the_command_line_prints_a_self_check_failure_whole(tmp_path, monkeypatch, capsys):
    from witness.record import Recorder
    from witness.record.selfcheck import SelfCheckFailed

    why = "step 0 does not replay: " + "a reason, " * 60 + "and the fix at the very end"

    def fail(self, progress=True):
        raise SelfCheckFailed(why)

    monkeypatch.setattr(Recorder, "train", fail)
    assert main(["train", "--task", "tiny", "--steps", "3", "--out", str(tmp_path / "a"), "--key",
                 str(tmp_path / "k.pem"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {why}"


def _task():
    return registry.build_task("dropout-test", {"steps": 6, "batch_size": 8})


def test_witness_train_prints_the_self_check(tmp_path, capsys):
    args = ["train", "--task", "tiny", "--steps", "5", "--out", str(tmp_path / "a"), "--key", str(tmp_path / "k.pem"),
            "--quiet"]
    assert main(args) == 0
    assert "self-check: step(s) 0 and " in capsys.readouterr().err
    assert main([*args[:6], str(tmp_path / "b"), *args[7:], "--no-self-check"]) == 0
    assert "self-check" not in capsys.readouterr().err


def test_gradient_accumulation_in_the_users_loop_replays_exactly(site, tmp_path, capsys):
    task = registry.build_task("dropout-test", {"steps": 6, "batch_size": 8, "grad_accum": 2})
    rec = _loop(task, tmp_path / "run")  # the self-check replayed two of its steps bit for bit
    assert len(rec.self_check.report()["steps"]) == 2
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "6", "--json"]) == 0
    capsys.readouterr()
    # a grad_accum of 1 stays out of the recipe (runs recorded before the field keep their recipe)
    assert "grad_accum" not in registry.build_task("dropout-test", {}).config_json()
    with pytest.raises(ValueError, match="must divide the batch"):
        registry.build_task("dropout-test", {"batch_size": 8, "grad_accum": 3})


def test_the_recorder_says_when_its_fixed_cost_dominates_and_what_state_every_buys(tmp_path, capsys):
    from witness.commit.signing import generate_key
    from witness.record import Commitments, Recorder
    from witness.record.records import HASH, PROBES
    from witness.task import build_task

    rec = Recorder.create(build_task("tiny", {"steps": 30}), tmp_path / "r", generate_key(), r=b"\x01" * 32)
    rec.train(progress=False)
    assert "witnessing cost" in capsys.readouterr().err  # every loop's closing line
    assert rec.part_seconds[PROBES] > 0 and rec.part_seconds[HASH] > 0  # measured, part by part
    c = rec.cost()
    assert c["step_seconds"] > 0 and c["record_seconds"] > 0 and 0 < c["share"] < 1
    assert (c["hint"] is not None) == (c["per_step"] > 0.05)
    # where the record costs more than 5 % of the step (the share here depends on the machine's load,
    # so it is set), the hint names a --state-every and what the audit pays for it
    rec.step_seconds = c["record_seconds"] / 0.2  # 20 % of a step: every 4 steps brings it to 5 %
    measured = dict(rec.part_seconds)
    rec.part_seconds = dict(measured, **{HASH: c["record_seconds"] * 0.7})  # where the hash is the most of it
    c = rec.cost()
    assert c["largest"] == HASH and "most of it the hash of the whole state" in c["hint"]
    assert c["state_every_hint"] == 4 and "--state-every 4" in c["hint"] and "up to 4 steps a challenge" in c["hint"]
    assert "2.5x its cost now" in c["hint"]
    # where the probes' forward is (issue 52, loops item 5: the hint blamed the hash all the same)
    rec.part_seconds = dict(measured, **{HASH: 0.0, PROBES: c["record_seconds"] * 0.7})
    c = rec.cost()
    assert c["largest"] == PROBES and "most of it the probes' forward" in c["hint"] and c["state_every_hint"] is None
    assert "--state-every" not in c["hint"] and "fewer or shorter probes" in c["hint"]
    assert "its largest part: the probes' forward" in rec.closing_line()
    rec.step_seconds = c["record_seconds"] / 0.04
    assert rec.cost()["hint"] is None
    sparse = Recorder.create(build_task("tiny", {"steps": 30}), tmp_path / "s", generate_key(), r=b"\x01" * 32,
                             commit=Commitments(checkpoint_every=10, state_every=10))
    sparse.train(progress=False)
    c = sparse.cost()  # the hash every 10 steps: whatever the recorder's cost, --state-every is not the way out
    assert c["state_every_hint"] is None and (c["hint"] is None or "--state-every" not in c["hint"])
