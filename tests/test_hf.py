"""A stock Hugging Face Trainer script, witnessed (examples/hf_trainer.py): trained, accepted by
the stock verifier offline and in cheap mode, and a tampered copy rejected."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import with_beacon

from witness.cli import main as witness
from witness.commit.hashing import canonical_json
from witness.commit.signing import load_key
from witness.verify import Evidence, Policy, Trust, Verifier
from witness.verify.respond import respond

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import hf_trainer  # noqa: E402 - the example script itself


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("hf")
    def train(url: str) -> None:  # with a beacon: the callback's recorder takes online challenges too
        assert hf_trainer.main(["--out", str(tmp / "run"), "--steps", "12", "--key", str(tmp / "k.pem"), "--beacon", url]) == 0

    return tmp / "run", tmp / "k.pem", with_beacon(tmp, train)


def test_the_trainer_run_replays_bit_for_bit(hf_run, tmp_path):
    run, *_ = hf_run
    manifest = json.loads((run / "log.jsonl").read_text().splitlines()[0])
    assert manifest["task"] == "hf-gpt2" and "task_source" not in manifest  # built in, pinned by the release
    # with GPT-2's dropout on: transformers draws its masks from torch's global generator, which each
    # step seeds from the committed step seed, in the Trainer's step and in replay alike
    assert manifest["task_config"]["dropout"] == 0.1
    v = Verifier(policy=Policy(challenges=12, nonce=b"all")).verify(run)  # offline, every step
    assert v.accepted and v.exact and v.replayed_steps == 12
    respond(run, tmp_path / "answer", nonce=b"cheap", challenges=6)
    assert Verifier(policy=Policy(challenges=6, nonce=b"cheap", mode="interactive")).verify(run, Evidence(response=tmp_path / "answer")).accepted


def test_a_tampered_trainer_run_is_rejected(hf_run, tmp_path, capsys):
    import shutil

    from helpers import resign

    run, key, _ = hf_run
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    lines = (bad / "log.jsonl").read_bytes().split(b"\n")[:-1]
    rec = json.loads(lines[7])  # step 6: a loss the Trainer never computed, re-signed by the trainer
    rec["loss"] = rec["loss"] * 0.9
    resign(bad, load_key(key), lines[:7] + [canonical_json(rec)] + lines[8:])
    assert witness(["verify", "--allow-weak", str(bad), "--challenges", "12", "--nonce", "01", "--json"]) == 1
    assert "step 6" in capsys.readouterr().out


def test_hf_gpt2_refuses_a_precision_its_trainer_step_would_not_replay():
    from witness.task import build_task

    with pytest.raises(ValueError, match="trains in fp32"):
        build_task("hf-gpt2", {"precision": "bf16"})


def test_the_trainer_run_took_online_challenges(hf_run):
    run, _, beacon_key = hf_run
    v = Verifier(Trust(beacon_key=beacon_key), Policy(mode="online")).verify(run)
    assert v.accepted and v.online["final"] and v.online["unaudited"] == 0 and v.replayed_steps == len(v.online["selected"])


def test_the_trainers_gradient_accumulation_replays_bit_for_bit(tmp_path):
    assert hf_trainer.main(["--out", str(tmp_path / "run"), "--steps", "4", "--key", str(tmp_path / "k.pem"),
                            "--grad-accum", "2"]) == 0
    v = Verifier(policy=Policy(challenges=4, nonce=b"accum")).verify(tmp_path / "run")
    assert v.accepted and v.replayed_steps == 4


def test_a_trainer_that_does_not_accumulate_as_the_recipe_says_is_refused(tmp_path):
    from transformers import Trainer, TrainingArguments

    from witness.commit.signing import generate_key
    from witness.integrations.committed import committed_dataset
    from witness.integrations.hf import attach
    from witness.record import Recorder
    from witness.task import build_task

    task = build_task("hf-gpt2", {"steps": 2, "batch_size": 8, "block": 16, "n_layer": 1, "n_head": 2,
                                  "d_model": 16, "corpus_max_bytes": 100_000, "grad_accum": 2})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x02" * 32)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=rec.model, args=args, train_dataset=committed_dataset(rec), optimizers=(rec.optimizer, None))
    with pytest.raises(ValueError, match="per_device_train_batch_size=4 and gradient_accumulation_steps=2"):
        attach(trainer, rec)


def test_the_trainer_with_torch_compile_is_refused_before_a_step_with_advice_it_can_follow(tmp_path):
    from transformers import Trainer, TrainingArguments

    from witness.commit.signing import generate_key
    from witness.integrations.committed import committed_dataset
    from witness.integrations.hf import attach
    from witness.record import Recorder
    from witness.task import build_task

    task = build_task("hf-gpt2", {"steps": 2, "batch_size": 8, "block": 16, "n_layer": 1, "n_head": 2,
                                  "d_model": 16, "corpus_max_bytes": 100_000})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x02" * 32)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, torch_compile=True)
    trainer = Trainer(model=rec.model, args=args, train_dataset=committed_dataset(rec), optimizers=(rec.optimizer, None))
    with pytest.raises(ValueError, match=r"torch_compile=True runs the step compiled.*leave torch_compile out of "
                                         r"TrainingArguments \(False, its default\)"):
        attach(trainer, rec)
    assert len(rec.log) == 1  # nothing but the manifest: no step ran
