"""The generic task's parts: sample codecs, schedules, the optimizer from the recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from witness.task.generic import (
    GenericConfig,
    GenericTask,
    step_decay,
    torch_schedule,
    warmup_cosine,
)
from witness.task.samples import SampleList, TensorSamples, TextSamples, TokenWindows


def test_tensor_samples_are_canonical_and_round_trip():
    codec = TensorSamples()
    a = {"y": torch.tensor(1), "x": torch.arange(6, dtype=torch.float32).view(2, 3)}
    b = {"x": torch.arange(6, dtype=torch.float32).view(2, 3).clone(), "y": torch.tensor(1)}
    assert codec.encode(a) == codec.encode(b)  # key order and storage do not change the bytes
    batch = codec.collate([codec.encode(a), codec.encode(b)])
    assert batch["x"].shape == (2, 2, 3) and torch.equal(batch["y"], torch.tensor([1, 1]))


def test_token_windows_read_a_uint16_bin_file(tmp_path):
    tokens = np.arange(1000, 1100, dtype="<u2")
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    d = TokenWindows(tmp_path / "train.bin", block=8)
    assert len(d) == (100 - 9) // 8 + 1
    assert d.sample_bytes(1) == tokens[8:17].tobytes()
    x, y = d.collate([d.sample_bytes(0), d.sample_bytes(2)])
    assert x.shape == (2, 8) and int(x[1, 0]) == 1016 and torch.equal(y[:, :-1], x[:, 1:])
    assert x.is_contiguous() and y.is_contiguous() and y.view(-1).shape == (16,)  # nanoGPT's targets.view(-1)
    with pytest.raises(ValueError, match="too few"):  # when the file is first read (building one reads no disk)
        len(TokenWindows(tmp_path / "train.bin", block=200))


def test_text_samples_are_utf8():
    codec = TextSamples()
    assert codec.collate([codec.encode("héllo"), codec.encode("x")]) == ["héllo", "x"]
    assert len(SampleList([b"a", b"b"])) == 2


def test_schedules_are_pure_functions_of_the_step():
    assert warmup_cosine(1.0, 0, 10, warmup=2) == 0.5 and warmup_cosine(1.0, 10, 10, warmup=2) == pytest.approx(0.1)
    assert step_decay(1.0, 25, every=10, gamma=0.5) == 0.25
    lrs = torch_schedule(0.1, 6, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert torch_schedule(0.1, 6, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)) == lrs


class Linear(GenericTask):
    name = "linear-test"

    def make_model(self):
        return torch.nn.Linear(3, 2)

    def make_dataset(self):
        return [{"x": torch.full((3,), float(i)), "y": torch.tensor(i % 2)} for i in range(32)]


def test_the_optimizer_comes_from_the_recipe_and_only_from_torch():
    t = Linear.from_config({"optimizer": "SGD", "optimizer_args": {"momentum": 0.9}, "lr": 0.5})
    opt = t.build_optimizer(t.build_model(b"\x01" * 32))
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9 and opt.defaults["lr"] == 0.5
    # the same seed builds the same weights; another seed others
    a, b, c = (t.build_model(s).weight for s in (b"\x01" * 32, b"\x01" * 32, b"\x02" * 32))
    assert torch.equal(a, b) and not torch.equal(a, c)
    for bad in ({"optimizer": "Optimizer"}, {"optimizer": "os.system"}, {"optimizer_args": {"lr": 1.0}},
                {"optimizer_args": {"betas": [{"a": 1}]}}, {"optimizer_args": {"foreach": True}}):
        with pytest.raises(ValueError):
            Linear.from_config(bad)
    assert GenericConfig().optimizer == "AdamW"
