"""A loop witnessed with its own model, optimizer and batch function (``witness.record.loop``): what
it adopts, what it refuses, and the steps it will not record."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from witness_example_nanogpt.model import GPT, GPTConfig, get_lr

from witness.commit.signing import generate_key
from witness.record import Recorder, SelfChecking, Training, start_run
from witness.task import build_task
from witness.verify import Policy, Verifier

MODEL = dict(block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
RECIPE = dict(steps=6, batch_size=4, grad_accum=2, lr=1e-3, min_lr=1e-4, warmup=2, weight_decay=0.1, grad_clip=1.0,
              optimizer_args={"betas": [0.9, 0.95]}, data="train.bin", **MODEL)


@pytest.fixture
def data(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 4000).astype(np.uint16).tofile(tmp_path / "train.bin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def own_objects(betas=(0.9, 0.95)):
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**MODEL))
    return model, model.configure_optimizers(0.1, 1e-3, betas)


def own_get_batch(split):
    x = torch.randint(0, 256, (2, 16))
    return x, torch.roll(x, -1, 1)


def recorder(data, model, optimizer=None):
    """The loop's objects adopted by a nanogpt-style run's recorder."""
    return Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                           training=Training(model=model, optimizer=optimizer))


def replays_every_step(data) -> None:
    v = Verifier(policy=Policy(mode="offline")).verify(data / "run")
    assert v.accepted and v.replayed_steps == RECIPE["steps"], v.reason


def train(rec, model, optimizer, steps, get_batch):
    X, Y = get_batch("train")
    for it in range(steps):
        lr = get_lr(it, 1e-3, 2, RECIPE["steps"], 1e-4)
        for g in optimizer.param_groups:
            g["lr"] = lr
        for _ in range(2):
            _, loss = model(X, Y)
            X, Y = get_batch("train")  # nanoGPT prefetches the next micro-batch before the backward
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_the_loops_own_objects_record_a_run_that_replays_every_step(data):
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer))
    # the model is the loop's object, with the initial state a verifier rebuilds from the run seed
    built = rec.task.build_model(rec.session.run_seed)
    assert rec.model is model and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                         built.state_dict().values(), strict=True))
    train(rec, model, optimizer, RECIPE["steps"], rec.batches(own_get_batch))
    rec.finish()
    v = Verifier(policy=Policy(mode="offline")).verify(data / "run")
    assert v.accepted and v.replayed_steps == RECIPE["steps"], v.reason


def test_a_loop_that_trains_on_batches_of_its_own_is_stopped_at_that_step(data):
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer))
    rec.batches(own_get_batch)  # the hooks are on, but the loop keeps its own data
    with pytest.raises(ValueError, match="0 of its 2 committed micro-batch"):
        train(rec, model, optimizer, 1, own_get_batch)


def test_a_changed_copy_of_a_committed_batch_is_not_the_committed_batch(data):
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer))
    get = rec.batches(own_get_batch)
    with pytest.raises(ValueError, match="committed micro-batch"):
        train(rec, model, optimizer, 1, lambda split: tuple(t.flip(0) for t in get(split)))


def test_a_step_beyond_the_recipe_fails_at_that_step_naming_nanogpts_off_by_one(data):
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer), self_check=SelfChecking(enabled=False))
    get = rec.batches(own_get_batch)
    with pytest.raises(ValueError, match=r"step 6: the recipe has 6 steps \(0\.\.5\)\. nanoGPT's train.py takes max_iters \+ 1"):
        train(rec, model, optimizer, RECIPE["steps"] + 1, get)
    assert rec.next_step == RECIPE["steps"]  # the six steps of the recipe were recorded; the seventh was not


def test_log_step_beyond_the_recipe_fails_at_that_step(data):
    rec = Recorder.create(build_task("tiny", {"steps": 2}), data / "run", generate_key(), r=bytes(32))
    rec.train(progress=False)
    with pytest.raises(ValueError, match="step 2 is beyond the recipe: the recipe has 2 steps"):
        rec.batch(2)


@pytest.mark.parametrize("change, message", [
    (lambda m, o: own_objects(betas=(0.9, 0.99)), r"betas is \(0.9, 0.99\) \(group 0\); the recipe's is \(0.9, 0.95\)"),
    (lambda m, o: (GPT(GPTConfig(**{**MODEL, "n_embd": 32})), None), "n_embd|transformer"),
    (lambda m, o: (m, torch.optim.SGD(m.parameters(), lr=1e-3)), "the loop's optimizer is SGD; the recipe's is AdamW"),
    (lambda m, o: (torch.nn.Linear(2, 2), None), "the loop's model is a Linear .*; the task's plugin builds a GPT"),
])
def test_objects_that_are_not_the_recipes_are_refused_before_a_step(data, change, message):
    model, optimizer = change(*own_objects())
    with pytest.raises(ValueError, match=message):
        Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                        training=Training(model=model, optimizer=optimizer))


def test_an_evaluation_inside_the_loop_is_the_loops_own(data):
    model, optimizer = own_objects()
    rec = start_run("nanogpt-style", RECIPE, str(data / "run"), model=model, optimizer=optimizer, key=str(data / "k.pem"))
    get = rec.batches(own_get_batch)
    with torch.no_grad():  # an evaluation: the loop's own batches, and the model's forward records nothing
        x, _ = get("train")
        model(x)
        assert get("val")[0].shape == (2, 16)
    train(rec, model, optimizer, RECIPE["steps"], get)
    rec.finish()
    assert Verifier(policy=Policy(mode="offline")).verify(data / "run").accepted


def test_an_option_given_in_its_old_form_is_refused_not_read_as_its_default(tmp_path):
    # self_check=False once turned the self-check off; read as "no options" it would turn it on
    from witness.commit.signing import generate_key
    from witness.record import Recorder
    from witness.task import build_task

    task = build_task("tiny", {"steps": 2})
    for name, value in (("self_check", False), ("commit", 5), ("training", {"threads": 1}), ("online", True)):
        with pytest.raises(TypeError, match=f"{name}= takes a witness.record"):
            Recorder.create(task, tmp_path / name, generate_key(), r=b"\x01" * 32, **{name: value})
        assert not (tmp_path / name).exists()  # refused before anything is written


class InnerTrainer:
    """minGPT's Trainer shape: ``run`` builds the optimizer (the model's ``configure_optimizers``)
    inside its own loop; the batches come from the function it is given."""

    def __init__(self, model, get_batch, steps):
        self.model, self.get_batch, self.steps = model, get_batch, steps

    def run(self):
        optimizer = self.model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        train(None, self.model, optimizer, self.steps, self.get_batch)


def test_an_optimizer_built_inside_a_trainer_is_adopted_at_its_first_step(data):
    model, _ = own_objects()
    rec = recorder(data, model)  # no optimizer: the Trainer builds its own
    InnerTrainer(model, rec.batches(own_get_batch), RECIPE["steps"]).run()
    rec.finish()
    replays_every_step(data)


def test_an_optimizer_the_recorder_was_not_given_is_refused_at_its_first_step(data):
    model, optimizer = own_objects()
    rec = recorder(data, model, optimizer)
    with pytest.raises(ValueError, match="Loops built inside a Trainer"):  # it would train unrecorded steps
        InnerTrainer(model, rec.batches(own_get_batch), 1).run()


def test_a_trainer_optimizer_unlike_the_recipes_names_build_optimizer(data):
    model, _ = own_objects()
    rec = recorder(data, model)
    get_batch = rec.batches(own_get_batch)
    one_group = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    with pytest.raises(ValueError, match="build_optimizer"):
        train(None, model, one_group, 1, get_batch)


def test_a_hooked_model_saves_with_torch_save_without_the_recorder(data, tmp_path):
    import io

    model, optimizer = own_objects()
    rec = recorder(data, model, optimizer)
    get_batch = rec.batches(own_get_batch)  # the hooks are on
    buf = io.BytesIO()
    torch.save(model, buf)  # the hooks hold the recorder (its key): a pickle leaves them out
    assert b"Recorder" not in buf.getvalue() and b"Hooked" not in buf.getvalue()
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    x = torch.randint(0, 256, (2, 16))
    model.eval(), copy.eval()
    with torch.no_grad():
        assert torch.equal(copy(x)[0], model(x)[0])  # the copy is the model, and records nothing
    model.train()
    train(rec, model, optimizer, RECIPE["steps"], get_batch)  # the run goes on
    rec.finish()
    replays_every_step(data)
