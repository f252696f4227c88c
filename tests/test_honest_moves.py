"""No honest configuration trips the bounded-move check, and a schedule cannot hide a step from it.

torch's Adam and AdamW skip a parameter whose gradient is None, weight decay included: a frozen
parameter in a decay group, a parameter a step does not use, one whose ``requires_grad`` a recipe
toggles, and every parameter of an fp16 step the GradScaler skipped keep their very bits. The red
team's finding: such a parameter was measured from its decayed value, so an honest run with a frozen
embedding at weight decay 1.0 was rejected every time. Each honest run here is trained and verified
through the command line, online, with every step's move checked.

A schedule whose rate rises after its warm-up (``min_lr_ratio`` above 1) is refused before the first
step; a task's own schedule that spikes is trained, and the verdict names the steps whose allowance
lr x B reaches the parameters' own scale, where the move check cannot tell a swapped model from a step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pytest
import test_fp16
import torch
import torch.nn.functional as F
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_evidence import Served
from torch import nn

from witness.bundle.checkpoint import read_checkpoint
from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.commit.signing import generate_key, save_key
from witness.task import registry
from witness.task.generic import GenericConfig, GenericTask

STEPS = 16


class Lookup(nn.Module):
    """An embedding bag and a linear head; its embedding's values are N(0, 1), most above B = 1.165."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


@dataclass(frozen=True)
class LookupConfig(GenericConfig):
    weight_decay: float = 1.0  # the red team's: AdamW's decoupled decay would move a value of 2 by 2 lr


class FrozenLookup(GenericTask):
    """A frozen embedding (fine-tuning a head on fixed features): the task's optimizer puts the
    embedding, a matrix, in its decay group all the same, as ``AdamW(model.parameters())`` would."""

    name = "frozen-lookup-test"
    Config = LookupConfig

    def make_model(self):
        model = Lookup()
        model.emb.weight.requires_grad_(False)
        return model

    def make_dataset(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, 32, (256, 6), generator=g)
        return [{"x": x[i], "y": x[i, 0] % 4} for i in range(256)]


class Unfreezing(FrozenLookup):
    """``requires_grad`` toggled mid-run: the embedding trains at the steps whose seed is even (a
    recipe that unfreezes a layer now and then), so it misses some of the optimizer's updates."""

    name = "unfreezing-test"

    def train_step(self, model, optimizer, batch, lr, seed, clip=None):
        model.emb.weight.requires_grad_(seed % 2 == 0)
        return super().train_step(model, optimizer, batch, lr, seed, clip)


class Fork(nn.Module):
    """Two heads, one used per batch (by the sign of its first input): the other gets no gradient."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 3)
        with torch.no_grad():  # values above B, so a decay that did not run would show
            self.a.weight.normal_(0.0, 2.0)
            self.b.weight.normal_(0.0, 2.0)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h) if bool(x[0, 0] > 0) else self.b(h)


class Branchy(GenericTask):
    name = "branchy-test"
    Config = LookupConfig

    def make_model(self):
        return Fork()

    def make_dataset(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(256, 8, generator=g)
        return [{"x": x[i], "y": x[i, :3].argmax()} for i in range(256)]


class Loud(test_fp16.Loud):
    """The fp16 suite's model (at fp16's first loss scale its gradients overflow, so the GradScaler skips
    the first steps: no update, no decay), its output weights above B, so a decay that did not run would
    show."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.out.weight.normal_(0.0, 2.0)


class Skipping(Branchy):
    name = "fp16-skips-test"

    def make_model(self):
        return Loud()

    def example_losses(self, outputs, batch):
        return F.cross_entropy(outputs.float(), batch["y"], reduction="none")


class Spiky(FrozenLookup):
    """A task whose own schedule spikes at its last step (what a recipe field can no longer ask for), to
    0.4: below the RMS of the embedding (about 1, most of the parameters), above the head's (about 0.14).
    The red team's model: an RMS over all parameters together hid the head's blind step."""

    name = "spiky-test"

    def make_model(self):
        return Lookup()

    spike = 0.4

    def lr_at(self, step):
        return self.spike if step == self.config.steps - 1 else self.config.lr


class FineSpiky(Spiky):
    """A spike to 0.02, twenty times the rate of every other step but below every tensor's RMS: the red
    team's second model (a fine-tune of the same start, swapped in at the spike, is nearer than any RMS)."""

    name = "fine-spiky-test"
    spike = 0.02


class TwoRates(FrozenLookup):
    """A task whose own step trains its head at ten times the schedule's rate (per-group rates)."""

    name = "two-rates-test"

    def make_model(self):
        return Lookup()

    def train_step(self, model, optimizer, batch, lr, seed, clip=None):
        original = optimizer.step

        def step(*args, **kw):
            optimizer.param_groups[-1]["lr"] = lr * 10  # the no-decay group: the head's bias
            return original(*args, **kw)

        optimizer.step = step
        try:
            return super().train_step(model, optimizer, batch, lr, seed, clip)
        finally:
            optimizer.step = original


TASKS = (FrozenLookup, Unfreezing, Branchy, Skipping, Spiky, FineSpiky, TwoRates)


@pytest.fixture(scope="module")
def beacon(tmp_path_factory):
    b = Served(f"sqlite:///{tmp_path_factory.mktemp('beacon') / 'b.db'}")
    yield b
    b.close()


@pytest.fixture(scope="module", autouse=True)
def tasks():
    with pytest.MonkeyPatch.context() as mp:
        for cls in TASKS:
            mp.setitem(registry.BUILTIN, cls.name, cls)  # as a plugin would register it
        registry._built.cache_clear()
        yield
    registry._built.cache_clear()


def train_and_verify(tmp_path, beacon, capsys, task: str, *config: str) -> tuple[int, dict]:
    """``witness train`` online through the beacon, then ``witness verify --mode online --json``. The key
    is fixed, so ``--seed`` gives every run of a task the same run seed: the same initial weights (the
    scales the verdict weighs steps against) on every machine and every run of the suite."""
    key = tmp_path / "key.pem"
    save_key(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(task.encode()).digest()), key)
    out = tmp_path / "run"
    args = ["train", "--task", task, "--steps", str(STEPS), "--checkpoint-every", "8", "--key", str(key), "--out",
            str(out), "--quiet", "--seed", task, "--beacon", beacon.url, "--online-p", "0.25", "--online-every", "4"]
    for c in config:
        args += ["--config", c]
    assert main(args) == 0
    capsys.readouterr()
    code = main(["verify", str(out), "--mode", "online", "--beacon-key", beacon.public_key, "--allow-weak", "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("decay", [0.1, 1.0])
def test_a_frozen_embedding_in_a_decay_group_is_honest(tmp_path, beacon, capsys, decay):
    code, v = train_and_verify(tmp_path, beacon, capsys, FrozenLookup.name, f"weight_decay={decay}")
    assert code == 0 and v["accepted"], v["failures"]
    assert v["moves"]["checked"] == STEPS and "AdamW" in v["moves"]["optimizer"]


@pytest.mark.parametrize("task", [Unfreezing.name, Branchy.name])
def test_parameters_a_step_does_not_train_are_honest(tmp_path, beacon, capsys, task):
    code, v = train_and_verify(tmp_path, beacon, capsys, task)
    assert code == 0 and v["accepted"], v["failures"]
    assert v["moves"]["checked"] == STEPS


def test_fp16_steps_the_scaler_skipped_are_honest(tmp_path, beacon, capsys):
    code, v = train_and_verify(tmp_path, beacon, capsys, Skipping.name, "precision=fp16", "lr=0.01")
    assert code == 0 and v["accepted"], v["failures"]
    assert v["moves"]["checked"] == STEPS
    # the GradScaler skipped steps (each halves the scale from its first 65536): those steps moved nothing
    final = read_checkpoint(open_bundle(tmp_path / "run").checkpoints[STEPS])
    assert float(final["scaler.scale"]) < 65536.0


def test_a_schedule_that_rises_after_its_warm_up_is_refused_before_the_first_step(tmp_path, capsys):
    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    code = main(["train", "--task", "tiny", "--steps", "40", "--key", str(key), "--out", str(tmp_path / "run"),
                 "--quiet", "--config", "warmup=38", "--config", "min_lr_ratio=20000"])
    assert code == 2 and "min_lr_ratio 20000" in capsys.readouterr().err
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_a_spike_in_a_tasks_own_schedule_is_named_in_the_verdict(tmp_path, beacon, capsys):
    code, v = train_and_verify(tmp_path, beacon, capsys, Spiky.name)
    assert code == 0 and v["accepted"], v["failures"]
    moves = v["moves"]
    assert moves["blind"] == [[STEPS - 1, STEPS - 1]] and moves["largest_step"] == STEPS - 1
    assert "model.head.weight" in moves["blind_tensors"] and "model.emb.weight" not in moves["blind_tensors"]
    assert moves["largest"] >= 0.4 > moves["scale"] and moves["scale_tensor"].startswith("model.head.")
    assert f"WARNING: at step(s) {STEPS - 1} a step may move a coordinate by the whole RMS of" in moves["summary"]
    assert any(f"step(s) {STEPS - 1} move a coordinate by the whole RMS of" in n for n in v["notes"])
    assert moves["spikes"] == [[STEPS - 1, STEPS - 1]]


def test_a_spike_below_every_tensors_scale_is_named_as_a_spike(tmp_path, beacon, capsys):
    code, v = train_and_verify(tmp_path, beacon, capsys, FineSpiky.name)
    assert code == 0 and v["accepted"], v["failures"]
    moves = v["moves"]
    assert moves["blind"] == [] and moves["spikes"] == [[STEPS - 1, STEPS - 1]]
    assert moves["largest"] > 10 * moves["median"] and moves["largest"] < moves["scale"]
    assert f"WARNING: step(s) {STEPS - 1} may move a coordinate over 10 times as far as" in moves["summary"]
    assert any(f"the schedule spikes at step(s) {STEPS - 1}" in n for n in v["notes"])


def test_honest_schedules_name_no_step(tmp_path, beacon, capsys):
    """Warm-up then cosine decay (the built-in recipes'), and a frozen embedding's run: no step is named."""
    code, v = train_and_verify(tmp_path, beacon, capsys, FrozenLookup.name, "warmup=4")
    assert code == 0 and v["moves"]["blind"] == [] and v["moves"]["spikes"] == []
    assert not any("spike" in n or "whole RMS" in n for n in v["notes"])


def test_per_group_rates_are_refused_at_the_step_not_rejected_by_every_verifier(tmp_path, beacon, capsys):
    """The move check holds every parameter to the record's one rate: a task that trains a group at
    another rate (the red team's: an honest run rejected by every verifier) is stopped at its first
    step with what to do, and trains and verifies online without the check."""
    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    args = ["train", "--task", TwoRates.name, "--steps", str(STEPS), "--checkpoint-every", "8", "--key", str(key),
            "--quiet", "--beacon", beacon.url, "--online-p", "0.25", "--online-every", "4"]
    assert main([*args, "--out", str(tmp_path / "chunked")]) == 2
    err = capsys.readouterr().err
    assert "step 0: the optimizer's groups trained at rates" in err and "--online-chunks 0" in err
    assert main([*args, "--out", str(tmp_path / "run"), "--online-chunks", "0"]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "run"), "--mode", "online", "--beacon-key", beacon.public_key,
                 "--allow-weak", "--json"])
    v = json.loads(capsys.readouterr().out)
    assert code == 0 and v["accepted"] and v["moves"] is None
