"""torch.compile: a recipe with compile=True runs its step compiled when recording and in replay
(the manifest records the recipe and the kernels' compiler), so the run replays bit for bit; a loop
that compiles a step the recipe does not compile is stopped at record time, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from witness.bundle.reader import open_bundle
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder, Training
from witness.record.selfcheck import SelfCheckFailed
from witness.task import build_task, registry
from witness.task.generic import GenericTask
from witness.verify import Policy, Verifier


class CompiledMLP(GenericTask):
    name = "compile-test"

    def make_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))

    def make_dataset(self):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(64, 8, generator=g)
        return [{"x": x[i], "y": x[i, :3].argmax()} for i in range(64)]

    def example_losses(self, outputs, batch):
        return F.cross_entropy(outputs, batch["y"], reduction="none")


@pytest.fixture(autouse=True)
def deterministic_mode_given_back():
    """A compiling recipe turns on torch's deterministic algorithms for the process: not for the next test."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def task(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, CompiledMLP.name, CompiledMLP)  # as a plugin would register it
    registry._built.cache_clear()
    yield lambda **c: build_task(CompiledMLP.name, {"steps": 4, "batch_size": 8, **c})
    registry._built.cache_clear()


def test_a_compiled_recipe_records_and_replays_its_compiled_step_bit_for_bit(task, tmp_path):
    t = task(compile=True)
    rec = Recorder.create(t, tmp_path / "run", generate_key(), r=b"\x01" * 32, commit=Commitments(checkpoint_every=2))
    assert rec.step_model is not rec.model  # the step runs compiled
    rec.train(progress=False)
    assert len(rec.self_check.report()["steps"]) == 2
    m = open_bundle(tmp_path / "run").manifest
    assert m.task_config["compile"] is True and m.device["compiler"]  # what made the kernels
    v = Verifier(policy=Policy(challenges=4, nonce=b"c")).verify(tmp_path / "run")
    assert v.accepted and v.replayed_steps == 4
    # the eager step is not the compiled one (its kernels round otherwise): an eager replay would not match
    eager = task()
    r2 = Recorder.create(eager, tmp_path / "eager", generate_key(), r=b"\x01" * 32,
                         commit=Commitments(checkpoint_every=2))
    r2.train(progress=False)
    assert open_bundle(tmp_path / "eager").steps[0].state_hash != open_bundle(tmp_path / "run").steps[0].state_hash


def test_a_loop_that_compiles_a_step_the_recipe_does_not_is_stopped_at_step_0(task, tmp_path):
    torch._dynamo.reset()  # a process that has compiled nothing yet, as a user's training script
    t = task()
    rec = Recorder.create(t, tmp_path / "run", generate_key(), r=b"\x02" * 32, commit=Commitments(checkpoint_every=2))
    compiled = torch.compile(rec.model)  # the user's own compile, which replay would not run
    batch = rec.batch(0)
    out = t.train_step(compiled, rec.optimizer, batch, rec.lr(0), rec.step_seed(0))
    with pytest.raises(SelfCheckFailed, match="torch.compile compiled, but the recipe does not compile"):
        rec.log_step(0, out)


class EmbeddingLM(GenericTask):
    """Embedding then Linear over a vocabulary: inductor's embedding backward is a scatter-add."""

    name = "compile-embedding"
    tied = False

    def make_model(self):
        m = nn.Sequential(nn.Embedding(512, 32), nn.Tanh(), nn.Linear(32, 512, bias=False))
        if self.tied:
            m[2].weight = m[0].weight
        return m

    def make_dataset(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, 512, (64, 24), generator=g)
        return [{"x": x[i, :-1].clone(), "y": x[i, 1:].clone()} for i in range(64)]

    def example_losses(self, outputs, batch):
        return F.cross_entropy(outputs.transpose(1, 2), batch["y"], reduction="none").mean(dim=1)


class TiedEmbeddingLM(EmbeddingLM):
    name = "compile-embedding-tied"
    tied = True


@pytest.mark.parametrize("cls", [EmbeddingLM, TiedEmbeddingLM], ids=["untied", "tied"])
def test_a_compiled_embedding_at_two_threads_replays_exactly(cls, monkeypatch, tmp_path):
    # Inductor's own embedding backward adds with atomics in a parallel loop: at 2 threads 11 of 12
    # backward passes of this model differed. The compiled recipe runs in torch's deterministic mode.
    monkeypatch.setitem(registry.BUILTIN, cls.name, cls)
    registry._built.cache_clear()
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        t = build_task(cls.name, {"steps": 6, "batch_size": 16, "compile": True})
        rec = Recorder.create(t, tmp_path / "run", generate_key(), r=b"\x05" * 32,
                              commit=Commitments(checkpoint_every=3), training=Training(threads=2))
        # the same backward, run again from one state, gives the same bits every time
        batch = rec.batch(0)
        grads = set()
        for _ in range(6):
            rec.model.zero_grad(set_to_none=True)
            t.step_loss(rec.step_model, batch, rec.step_seed(0)).backward()
            grads.add(rec.model[0].weight.grad.numpy().tobytes())
        rec.model.zero_grad(set_to_none=True)
        assert len(grads) == 1
        rec.train(progress=False)
        assert rec.self_check.report()["steps"]
        v = Verifier(policy=Policy(challenges=6, nonce=b"e")).verify(tmp_path / "run")
        assert v.accepted and v.exact and v.replayed_steps == 6
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])
        registry._built.cache_clear()
