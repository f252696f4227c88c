"""What a red team found in the wrapped-loop and data-by-content changes, each as an attack or an
honest run that must come out right: decoding that followed the verifier's disk, a model's side
file, a batch changed in place, hooks left from a failed run, a collator dropped, a symlink loop,
and pins for files a task never reads."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_own_objects import RECIPE, data, own_get_batch, own_objects, train  # noqa: F401 - the fixture

from witness.commit.signing import generate_key
from witness.data import locate
from witness.errors import VerificationError
from witness.record import Recorder, Training
from witness.task import build_task, registry
from witness.task.generic import GenericTask
from witness.task.samples import TokenWindows
from witness.verify import Policy, Verifier


class PathWindows(GenericTask):
    """Token windows given as a path the task looked up itself (data_file's Path, not the name)."""

    name = "rt-path-windows"

    def make_model(self):
        return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))

    def make_dataset(self):
        return TokenWindows(locate.data_file("train.bin"), 8)


class NamedWindows(PathWindows):
    name = "rt-named-windows"

    def make_dataset(self):
        return TokenWindows("train.bin", 8)


class VocabModel(GenericTask):
    """A model whose size is read from a side file, on a list of samples read from another."""

    name = "rt-vocab-model"

    def make_model(self):
        n = len(json.loads(locate.data_file("vocab.json").read_text())["chars"])
        return torch.nn.Linear(n, 3)

    def make_dataset(self):
        rows = [line.split(",") for line in locate.data_file("points.csv").read_text().splitlines()]
        return [{"x": torch.tensor([float(v) for v in r[:-1]]), "y": torch.tensor(int(r[-1]))} for r in rows]


@pytest.fixture
def plugins(monkeypatch):
    for cls in (PathWindows, NamedWindows, VocabModel):
        monkeypatch.setitem(registry.BUILTIN, cls.name, cls)
    registry._built.cache_clear()
    yield
    registry._built.cache_clear()


def test_how_samples_decode_never_depends_on_the_files_a_machine_holds(plugins, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tokens = np.arange(100, dtype="<u2").tobytes()
    window = tokens[:18]
    for present in (False, True):  # the same answer with the data there and without it
        if present:
            (tmp_path / "train.bin").write_bytes(tokens)
        registry._built.cache_clear()
        x, _ = build_task("rt-named-windows", {}).collate([window])  # a name: TokenWindows is its own codec
        assert x.shape == (1, 8)
        with pytest.raises(VerificationError, match="do not decode as the task 'rt-path-windows'"):
            build_task("rt-path-windows", {}).collate([window])  # a path: the task's declared samples, always


def test_a_side_file_the_model_reads_is_found_by_its_content(plugins, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"chars": "abcd"}))
    g = torch.Generator().manual_seed(0)
    (tmp_path / "points.csv").write_text("\n".join(",".join(f"{v:.3f}" for v in torch.randn(4, generator=g).tolist())
                                                   + f",{i % 3}" for i in range(64)))
    rec = Recorder.create(build_task("rt-vocab-model", {"steps": 3, "batch_size": 4}), tmp_path / "run",
                          generate_key(), r=bytes(32))
    rec.train(progress=False)
    assert set(rec.manifest["data_files"]) == {"vocab.json", "points.csv"}
    other = tmp_path / "elsewhere" / "deep"
    other.mkdir(parents=True)
    shutil.move(tmp_path / "vocab.json", other / "tok.json")
    shutil.move(tmp_path / "points.csv", other / "rows.csv")
    registry._built.cache_clear()
    with locate.data_dirs([tmp_path / "elsewhere"]):
        v = Verifier(policy=Policy(mode="offline")).verify(tmp_path / "run")
    assert v.accepted and any("'vocab.json' is" in n or "'points.csv' is" in n for n in [*v.notes, *v.checks]), v.notes


def test_a_committed_batch_changed_in_place_is_refused_at_its_forward(data):  # noqa: F811
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer))
    get = rec.batches(own_get_batch)

    def masked(split):
        x, y = get(split)
        y[:, :4] = -1  # ignore-index masking, in place: not the batch a verifier replays
        return x, y

    with pytest.raises(ValueError, match="changed in place"):
        train(rec, model, optimizer, 1, masked)


def test_a_second_run_after_a_failed_one_takes_over_its_hooks_and_generators(data):  # noqa: F811
    model, optimizer = own_objects()
    rec = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run", generate_key(), r=bytes(32),
                          training=Training(model=model, optimizer=optimizer))
    get = rec.batches(own_get_batch)
    torch.manual_seed(1234)
    x, y = get("train")
    model(x, y)  # a forward, then the loop fails before its step: the generators are the step's now
    assert torch.initial_seed() != 1234
    rec2 = Recorder.create(build_task("nanogpt-style", RECIPE), data / "run2", generate_key(), r=bytes(32),
                           training=Training(model=model, optimizer=optimizer))
    assert torch.initial_seed() == 1234  # given back when the failed run's hooks were taken down
    train(rec2, model, optimizer, RECIPE["steps"], rec2.batches(own_get_batch))
    rec2.finish()
    assert Verifier(policy=Policy(mode="offline")).verify(data / "run2").accepted


def test_a_collator_of_the_scripts_own_is_refused_not_dropped(tmp_path, monkeypatch):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from witness_clm import run_clm

    from witness.integrations.hf import attach
    from witness.record import start_run

    work = tmp_path / "p"
    (work / "data" / "clm").mkdir(parents=True)
    (work / "data" / "clm" / "train.txt").write_text("abc def\n" * 300)
    (work / "data" / "clm" / "vocab.json").write_text(json.dumps({"chars": " \nabcdef"}))
    monkeypatch.chdir(work)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True)
    data_ = run_clm.load_blocks("data/clm/train.txt", "data/clm/vocab.json", block=32)
    model = run_clm.build_model(8, block=32)
    rec = start_run("clm", vars(args), str(tmp_path / "run"), model=model, key=str(tmp_path / "k.pem"))

    class Tok:  # the least a language-model collator asks of a tokenizer
        pad_token, mask_token = "<pad>", None

    collator = DataCollatorForLanguageModeling.__new__(DataCollatorForLanguageModeling)
    collator.tokenizer = Tok()
    with pytest.raises(ValueError, match="data_collator is the script's own"):
        attach(Trainer(model=model, args=args, train_dataset=data_, data_collator=collator), rec)


def test_a_loader_with_a_collate_fn_of_its_own_is_refused(tmp_path):
    import lightning as L
    from witness_lit import train_lit

    from witness.integrations.lightning import committed_loader
    from witness.record import start_run

    model = train_lit.LitClassifier()
    loader = torch.utils.data.DataLoader(train_lit.points(), batch_size=8, collate_fn=lambda b: b)
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    rec = start_run("lit-points", {"trainer": trainer, "loader": loader}, str(tmp_path / "run"), model=model,
                    key=str(tmp_path / "k.pem"))
    with pytest.raises(ValueError, match="collate_fn is the script's own"):
        committed_loader(rec, loader)


def test_a_symlink_loop_in_a_data_folder_is_passed_over(tmp_path):
    (tmp_path / "loop.bin").symlink_to(tmp_path / "loop.bin")
    (tmp_path / "real.bin").write_bytes(b"x" * 10)
    with locate.data_dirs([tmp_path]):
        assert [p.name for p in locate.candidates("train.bin")] == ["real.bin"]


def test_only_the_names_a_task_asks_for_are_searched_by_content(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(locate, "find_by_content", lambda *a: calls.append(a[0]) or None)
    pins = {f"never-{i}.bin": {"sha256": "00" * 32, "size": 1} for i in range(60)}
    pins["asked.bin"] = {"sha256": "00" * 32, "size": 1}
    with locate.by_content(pins), pytest.raises(FileNotFoundError, match="'asked.bin' \\(sha256 0000"):
        locate.data_file("asked.bin")
    assert calls == ["asked.bin"]  # the 60 names the task never read cost nothing
