"""A Lightning run, witnessed (examples/lightning_train.py): trained, accepted by the stock
verifier offline and in cheap mode, and a tampered copy rejected."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import resign, with_beacon

from witness.cli import main as witness
from witness.commit.hashing import canonical_json
from witness.commit.signing import load_key
from witness.verify import Evidence, Policy, Trust, Verifier
from witness.verify.respond import respond

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import lightning_train  # noqa: E402 - the example script itself


@pytest.fixture(scope="module")
def pl_run(tmp_path_factory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("pl")
    def train(url: str) -> None:  # with a beacon: the callback's recorder takes online challenges too
        assert lightning_train.main(["--out", str(tmp / "run"), "--steps", "12", "--key", str(tmp / "k.pem"), "--beacon", url]) == 0

    return tmp / "run", tmp / "k.pem", with_beacon(tmp, train)


def test_the_lightning_run_replays_bit_for_bit(pl_run, tmp_path):
    run, *_ = pl_run
    v = Verifier(policy=Policy(challenges=12, nonce=b"all")).verify(run)  # offline, every step (dropout included)
    assert v.accepted and v.exact and v.replayed_steps == 12
    respond(run, tmp_path / "answer", nonce=b"cheap", challenges=6)
    assert Verifier(policy=Policy(challenges=6, nonce=b"cheap", mode="interactive")).verify(run, Evidence(response=tmp_path / "answer")).accepted


def test_a_tampered_lightning_run_is_rejected(pl_run, tmp_path, capsys):
    run, key, _ = pl_run
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    lines = (bad / "log.jsonl").read_bytes().split(b"\n")[:-1]
    rec = json.loads(lines[5])  # step 4: a gradient norm the run never had, re-signed by the trainer
    rec["grad_norm"] = rec["grad_norm"] * 2
    resign(bad, load_key(key), lines[:5] + [canonical_json(rec)] + lines[6:])
    assert witness(["verify", "--allow-weak", str(bad), "--challenges", "12", "--nonce", "01", "--json"]) == 1
    assert "step 4" in capsys.readouterr().out


def test_a_loader_off_the_committed_order_is_refused(tmp_path):
    import lightning as L
    import torch

    from witness.commit.signing import generate_key
    from witness.integrations.committed import same_batch
    from witness.integrations.lightning import TaskModule, WitnessCallback
    from witness.record import Commitments, Recorder
    from witness.task import build_task

    t = torch.arange(6).view(2, 3)
    assert same_batch({"x": t, "y": (t, [1])}, {"x": t.clone(), "y": (t, [1])})
    assert not same_batch({"x": t}, {"x": t + 1}) and not same_batch(t, {"x": t}) and not same_batch([t], [t, t])

    task = build_task("tinygpt", {"steps": 3, "batch_size": 4, "block": 16, "n_layer": 1, "d_model": 16, "n_head": 2,
                                  "probes": 2, "probe_len": 8, "corpus_max_bytes": 100_000})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x02" * 32,
                          commit=Commitments(checkpoint_every=3))

    class Shuffled(TaskModule):
        def train_dataloader(self):
            loader = super().train_dataloader()
            return torch.utils.data.DataLoader(loader.dataset, batch_size=4, shuffle=True, collate_fn=task.collate)

    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[WitnessCallback(rec)])
    with pytest.raises(ValueError, match="not the committed one"):
        trainer.fit(Shuffled(rec))


def test_a_bf16_recipe_under_lightning_replays_bit_for_bit(tmp_path):
    import lightning as L

    from witness.commit.signing import generate_key
    from witness.integrations.lightning import TaskModule, WitnessCallback
    from witness.record import Commitments, Recorder
    from witness.task import build_task

    task = build_task("tinygpt", {"steps": 3, "batch_size": 4, "block": 16, "n_layer": 1, "d_model": 16, "n_head": 2,
                                  "probes": 2, "probe_len": 8, "corpus_max_bytes": 100_000, "precision": "bf16"})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x05" * 32,
                          commit=Commitments(checkpoint_every=3))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[WitnessCallback(rec)])
    trainer.fit(TaskModule(rec))
    v = Verifier(policy=Policy(challenges=3, nonce=b"bf16")).verify(tmp_path / "run")  # replay applies the recipe's autocast
    assert v.accepted and v.replayed_steps == 3


def test_the_lightning_run_took_online_challenges(pl_run):
    run, _, beacon_key = pl_run
    v = Verifier(Trust(beacon_key=beacon_key), Policy(mode="online")).verify(run)
    assert v.accepted and v.online["final"] and v.online["unaudited"] == 0 and v.replayed_steps == len(v.online["selected"])


def test_lightning_gradient_accumulation_and_clip_val_replay_exactly(tmp_path):
    import lightning as L

    from witness.commit.signing import generate_key
    from witness.integrations.lightning import TaskModule, WitnessCallback
    from witness.record import Commitments, Recorder
    from witness.task import build_task

    recipe = {"steps": 4, "batch_size": 4, "block": 16, "n_layer": 1, "d_model": 16, "n_head": 2, "probes": 2,
              "probe_len": 8, "corpus_max_bytes": 100_000, "grad_accum": 2}
    task = build_task("tinygpt", recipe)
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x06" * 32,
                          commit=Commitments(checkpoint_every=2))
    kw = dict(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    # Lightning's own accumulation and clipping flags, set as the recipe says
    L.Trainer(accumulate_grad_batches=2, gradient_clip_val=task.config.grad_clip, callbacks=[WitnessCallback(rec)],
              **kw).fit(TaskModule(rec))
    assert rec.self_check.report()["steps"]  # replayed as it was recorded
    v = Verifier(policy=Policy(challenges=4, nonce=b"accum")).verify(tmp_path / "run")
    assert v.accepted and v.replayed_steps == 4
    # settings that are not the recipe's are refused before the first step
    rec2 = Recorder.create(task, tmp_path / "other", generate_key(), r=b"\x06" * 32,
                           commit=Commitments(checkpoint_every=2))
    with pytest.raises(ValueError, match="accumulate_grad_batches=2"):
        L.Trainer(callbacks=[WitnessCallback(rec2)], **kw).fit(TaskModule(rec2))
    rec3 = Recorder.create(task, tmp_path / "third", generate_key(), r=b"\x06" * 32,
                           commit=Commitments(checkpoint_every=2))
    with pytest.raises(ValueError, match="gradient_clip_val must be the recipe's grad_clip"):
        L.Trainer(accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[WitnessCallback(rec3)],
                  **kw).fit(TaskModule(rec3))
