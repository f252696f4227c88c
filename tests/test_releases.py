"""Runs recorded by an older release verify under this one, exactly when the verifier's own list
says it replays them (``witness.REPLAYS_RUNS_OF``); any other release is refused, and so is a
resume that would mix two releases' steps in one run.

``tests/data/release-0.3.0`` holds what witness 0.3.0 (commit 06f7969) recorded: a whole ``tiny``
bundle, and the manifest, first step and batch of a ``tinygpt`` run (its corpus is this machine's
standard library, so the batch's bytes are stored with it). See that folder's README.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import edit_manifest, train_tiny

import witness
from witness.bundle.reader import open_bundle
from witness.bundle.schema import Manifest, StepRecord
from witness.bundle.state import state_hash, state_tensors
from witness.cli import main
from witness.commit.hashing import parse_canonical_json
from witness.commit.signing import generate_key
from witness.data.dataset import batch_root, sample_hash
from witness.errors import MalformedInput
from witness.record import Recorder
from witness.session import TrainingSession
from witness.task import build_task
from witness.verify import verify_bundle

OLD = Path(__file__).parent / "data" / "release-0.3.0"


def test_this_release_replays_its_own_runs_and_those_of_0_3_0():
    assert witness.replays(witness.__version__) and witness.replays("0.3.0")
    assert not witness.replays("0.2.0") and not witness.replays("0.1.0")


def test_a_bundle_recorded_by_0_3_0_verifies_bit_for_bit(tmp_path, capsys):
    bundle = tmp_path / "b"
    shutil.copytree(OLD / "tiny", bundle)
    opened = open_bundle(bundle)
    assert opened.manifest.code_version == "0.3.0"
    steps = len(opened.steps)
    v = verify_bundle(opened, challenges=steps, nonce=b"every step")  # exact replay of every step
    assert v.accepted and v.complete and v.replayed_steps == steps
    assert main(["verify", str(bundle), "--challenges", str(steps)]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_a_tinygpt_recipe_of_0_3_0_builds_and_steps_the_same():
    doc = json.loads((OLD / "tinygpt-step0.json").read_text())
    manifest = Manifest.parse(parse_canonical_json(doc["log"][0].encode()))
    record = StepRecord.parse(parse_canonical_json(doc["log"][1].encode()), "step 0")
    assert manifest.code_version == "0.3.0" and manifest.task == "tinygpt"
    task = build_task(manifest.task, manifest.task_config)
    assert task.config_json() == manifest.task_config  # still the canonical form of the recipe
    assert task.probe_hash().hex() == manifest.probe_hash.hex()
    assert task.fingerprint_spec() == manifest.raw["fingerprint_spec"]
    session = TrainingSession(task, manifest.run_seed, manifest.dataset_size)
    init = state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest)
    assert init == manifest.init_state_hash
    assert session.batch_indices(0) == list(record.batch)
    samples = [bytes.fromhex(s) for s in doc["samples"]]
    assert batch_root([sample_hash(s) for s in samples]) == record.batch_root  # the run's own batch
    out = session.step(0, samples)
    assert out.loss == record.loss and session.lr(0) == record.lr
    assert session.fingerprint().digest == record.digest.hex()
    assert tuple(session.sketch()) == record.sketch
    assert state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest) == record.state_hash


@pytest.mark.parametrize("release", ["0.2.0", "0.3.1", "1.0.0"])
def test_a_run_of_a_release_outside_the_list_is_refused(tmp_path, release):
    key = generate_key()
    bundle = train_tiny(tmp_path / "b", key, config={"steps": 4}, checkpoint_every=2)
    edit_manifest(bundle, key, code_version=release)
    with pytest.raises(MalformedInput, match=f"recorded by witness {release}; .* replays runs of 0.3.0"):
        verify_bundle(bundle, challenges=1)
    assert main(["verify", str(bundle), "--challenges", "1"]) == 2


@pytest.mark.parametrize("release, resumes", [("0.3.0", True), ("0.2.0", False)])
def test_a_resume_continues_only_a_run_whose_steps_this_release_reproduces(tmp_path, release, resumes):
    key = generate_key()
    task = build_task("tiny", {"steps": 8})
    rec = Recorder.create(task, tmp_path / "b", key, r=b"\x03" * 32, checkpoint_every=4)
    for t in range(4):  # killed right after the checkpoint at step 4
        rec.log_step(t, rec.task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    del rec
    edit_manifest(tmp_path / "b", key, code_version=release)
    if not resumes:
        with pytest.raises(ValueError, match=f"started by witness {release}, whose steps this release"):
            Recorder.resume(tmp_path / "b", key)
        return
    resumed = Recorder.resume(tmp_path / "b", key)
    assert resumed.start_step == 4
    resumed.train(progress=False)
    assert verify_bundle(tmp_path / "b", challenges=8, nonce=b"all").accepted
