"""A run_clm-style Hugging Face script (examples/hf_clm) witnessed as it is written: its own GPT-2,
its own tokenizer (a side file) and its own list-of-blocks dataset read from a text file, a stock
Trainer with its own AdamW and schedule. The verifier needs only the bundle for the cheap audit,
and finds every file the plugin reads by its content for the offline one."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import with_beacon

from witness.cli import main
from witness.task import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_clm"


def test_the_script_takes_at_most_10_witness_lines_and_the_plugin_at_most_40():
    code = (EXAMPLE / "run_clm.py").read_text()
    body = code.split('"""', 2)[2]
    marked = [line for line in body.splitlines() if re.search(r"#\s*witness\b", line)]
    assert 1 <= len(marked) <= 10
    plain = "\n".join(line for line in body.splitlines() if not re.search(r"#\s*witness\b", line))
    ast.parse(plain)  # without them it is the plain script: nothing of its own was replaced
    assert "Trainer(model=model, args=args, train_dataset=train_dataset)" in plain
    assert len((EXAMPLE / "witness_clm" / "__init__.py").read_text().splitlines()) <= 40


def run(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, *args], cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("clm") / "project"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    p = run(work, "prepare.py", "--chars", "20000")
    assert p.returncode == 0, p.stderr
    p = run(work, "run_clm.py", "--max_steps", "8", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2")
    assert p.returncode == 0, p.stderr
    assert "bit for bit" in p.stderr
    return work


def test_the_cheap_audit_needs_nothing_but_the_bundle(work, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(work)
    assert main(["respond", "out/witness", "--nonce", "0a0b", "--challenges", "3", "--out", str(tmp_path / "r")]) == 0
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")  # no text file, no vocabulary
    registry._built.cache_clear()
    assert main(["verify", "--allow-weak", str(work / "out" / "witness"), "--mode", "interactive", "--nonce", "0a0b",
                 "--challenges", "3", "--response", str(tmp_path / "r")]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_the_offline_audit_finds_the_text_and_the_tokenizer_by_their_content(work, tmp_path, capsys, monkeypatch):
    manifest = json.loads((work / "out" / "witness" / "log.jsonl").read_text().splitlines()[0])
    assert set(manifest["data_files"]) == {"data/clm/train.txt", "data/clm/vocab.json"}
    moved = tmp_path / "elsewhere" / "x"
    moved.mkdir(parents=True)
    shutil.copy(work / "data" / "clm" / "train.txt", moved / "corpus.txt")
    shutil.copy(work / "data" / "clm" / "vocab.json", moved / "tokenizer.json")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    registry._built.cache_clear()
    assert main(["verify", str(work / "out" / "witness"), "--data", str(tmp_path / "elsewhere")]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED" in out and f"'data/clm/vocab.json' is {moved / 'tokenizer.json'} (found by its content)" in out
    # another vocabulary is not the run's: nothing has the committed content, and the verdict says which file
    (moved / "tokenizer.json").write_text(json.dumps({"chars": "abc"}))
    registry._built.cache_clear()
    assert main(["verify", str(work / "out" / "witness"), "--data", str(tmp_path / "elsewhere")]) == 2
    assert "'data/clm/vocab.json' (sha256" in capsys.readouterr().err


def test_a_dataset_that_is_not_the_plugins_is_refused_before_a_step(work, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments
    from witness_clm import run_clm

    from witness.integrations.hf import attach
    from witness.record import start_run

    monkeypatch.chdir(work)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-3, warmup_steps=1, report_to=[], use_cpu=True)
    data = run_clm.load_blocks("data/clm/train.txt", "data/clm/vocab.json", block=32)
    model = run_clm.build_model(len(run_clm.load_vocab("data/clm/vocab.json")), block=32)
    rec = start_run("clm", vars(args), str(tmp_path / "run"), model=model, key=str(tmp_path / "k.pem"))
    with pytest.raises(ValueError, match="the loop's dataset .* is not the task's"):
        attach(Trainer(model=model, args=args, train_dataset=data[1:]), rec)  # one sample short


def test_online_mode_is_one_environment_variable(work, tmp_path, capsys):
    def train(url):
        p = run(work, "run_clm.py", "--max_steps", "6", "--output_dir", "online", env={"WITNESS_BEACON": url})
        assert p.returncode == 0, p.stderr

    key = with_beacon(tmp_path, train)
    assert main(["verify", "--allow-weak", str(work / "online" / "witness"), "--mode", "online", "--beacon-key", key]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


@pytest.mark.parametrize("setting, message", [
    (dict(optim="adafactor"), "the Trainer's optim is 'adafactor'"),
    (dict(adam_beta2=0.95), "adam_beta1/adam_beta2/adam_epsilon"),
])
def test_trainer_settings_the_recipe_does_not_have_are_refused(work, tmp_path, monkeypatch, setting, message):
    from transformers import Trainer, TrainingArguments
    from witness_clm import run_clm

    from witness.integrations.hf import attach, trainer_recipe
    from witness.record import start_run

    monkeypatch.chdir(work)
    base = dict(output_dir=str(tmp_path / "t"), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                warmup_steps=1, report_to=[], use_cpu=True)
    data = run_clm.load_blocks("data/clm/train.txt", "data/clm/vocab.json", block=32)
    model = run_clm.build_model(len(run_clm.load_vocab("data/clm/vocab.json")), block=32)
    rec = start_run("clm", vars(TrainingArguments(**base)), str(tmp_path / "run"), model=model,
                    key=str(tmp_path / "k.pem"))
    assert trainer_recipe(TrainingArguments(**base))["optimizer_args"] == {"betas": [0.9, 0.999], "eps": 1e-8}
    # the recipe is built before the script changes its arguments: the Trainer would step another optimizer
    with pytest.raises(ValueError, match=message):
        attach(Trainer(model=model, args=TrainingArguments(**base, **setting), train_dataset=data), rec)
    # a second run in the same process (its task built from the cache) still pins its data files
    rec2 = start_run("clm", vars(TrainingArguments(**base)), str(tmp_path / "run2"), model=model,
                     key=str(tmp_path / "k.pem"))
    assert set(rec2.manifest["data_files"]) == {"data/clm/train.txt", "data/clm/vocab.json"}


def test_an_environment_that_makes_accelerate_compile_is_refused_before_a_step(work, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments
    from witness_clm import run_clm

    from witness.integrations.hf import attach
    from witness.record import start_run

    monkeypatch.chdir(work)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True)
    data = run_clm.load_blocks("data/clm/train.txt", "data/clm/vocab.json", block=32)
    model = run_clm.build_model(len(run_clm.load_vocab("data/clm/vocab.json")), block=32)
    rec = start_run("clm", vars(args), str(tmp_path / "run"), model=model, key=str(tmp_path / "k.pem"))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")  # as TrainingArguments(torch_compile=True) leaves it
    with pytest.raises(ValueError, match="ACCELERATE_DYNAMO_BACKEND=inductor in the environment"):
        attach(Trainer(model=model, args=args, train_dataset=data), rec)


def test_under_torchrun_each_rank_accumulates_its_share_and_one_process_replays_it_offline_and_online(
        work, tmp_path, capsys):
    """The same script under `torchrun --standalone --nproc_per_node=2` (gloo): the Trainer's own DDP, each rank
    two micro-batches of the step's four, WITNESS_BEACON for the online run."""
    def torchrun(out: str, env: dict | None = None) -> None:
        p = run(work, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "run_clm.py", "--max_steps",
                "6", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2", "--output_dir", out,
                env=env)
        assert p.returncode == 0, p.stderr[-3000:]

    torchrun("ranks")
    manifest = json.loads((work / "ranks" / "witness" / "log.jsonl").read_text().splitlines()[0])
    assert (manifest["world_size"], manifest["task_config"]["grad_accum"]) == (2, 4)
    assert main(["verify", str(work / "ranks" / "witness"), "--mode", "offline", "--data", str(work)]) == 0
    assert "6 step(s) replayed = 100.00%" in capsys.readouterr().out
    key = with_beacon(tmp_path, lambda url: torchrun("ranks_online", {"WITNESS_BEACON": url}))
    assert main(["verify", "--allow-weak", str(work / "ranks_online" / "witness"), "--mode", "online", "--beacon-key",
                 key, "--data", str(work)]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
