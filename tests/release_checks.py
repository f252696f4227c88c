"""Replays what witness 0.3.0 recorded (``tests/data/release-0.3.0``) with this release.

Run by ``test_releases.py`` in a process of its own, whose CPU kernels it pins:
``python release_checks.py CHECK TMPDIR`` prints ``CHECK: ok`` or fails with an AssertionError.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from witness.bundle.reader import open_bundle
from witness.bundle.schema import Manifest, StepRecord
from witness.bundle.state import state_hash, state_tensors
from witness.cli import main
from witness.commit.hashing import parse_canonical_json
from witness.data.dataset import batch_root, sample_hash
from witness.session import TrainingSession
from witness.task import build_task
from witness.verify import verify_bundle

OLD = Path(__file__).parent / "data" / "release-0.3.0"


def tiny_bundle_verifies(tmp: Path) -> None:
    """The whole 0.3.0 bundle verifies, every step replayed bit for bit, and through the CLI."""
    bundle = tmp / "b"
    shutil.copytree(OLD / "tiny", bundle)
    opened = open_bundle(bundle)
    assert opened.manifest.code_version == "0.3.0"
    steps = len(opened.steps)
    v = verify_bundle(opened, challenges=steps, nonce=b"every step")
    assert v.accepted and v.complete and v.replayed_steps == steps, v
    assert any("did not record its CPU's kernel choice" in n for n in v.notes), v.notes
    assert main(["verify", str(bundle), "--challenges", str(steps)]) == 0


def tinygpt_step_is_the_same(tmp: Path) -> None:
    """The 0.3.0 tinygpt recipe builds the same task and state, and its step 0 gives the same bits."""
    doc = json.loads((OLD / "tinygpt-step0.json").read_text())
    manifest = Manifest.parse(parse_canonical_json(doc["log"][0].encode()))
    record = StepRecord.parse(parse_canonical_json(doc["log"][1].encode()), "step 0")
    assert manifest.code_version == "0.3.0" and manifest.task == "tinygpt"
    task = build_task(manifest.task, manifest.task_config)
    assert task.config_json() == manifest.task_config  # still the canonical form of the recipe
    assert task.probe_hash() == manifest.probe_hash
    assert task.fingerprint_spec() == manifest.raw["fingerprint_spec"]
    session = TrainingSession(task, manifest.run_seed, manifest.dataset_size)
    assert state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest) == manifest.init_state_hash
    assert session.batch_indices(0) == list(record.batch)
    samples = [bytes.fromhex(s) for s in doc["samples"]]
    assert batch_root([sample_hash(s) for s in samples]) == record.batch_root  # the run's own batch
    out = session.step(0, samples)
    assert out.loss == record.loss and session.lr(0) == record.lr
    assert session.fingerprint().digest == record.digest.hex()
    assert tuple(session.sketch()) == record.sketch
    assert state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest) == record.state_hash


CHECKS = {f.__name__: f for f in (tiny_bundle_verifies, tinygpt_step_is_the_same)}

if __name__ == "__main__":
    name, tmp = sys.argv[1], Path(sys.argv[2])
    CHECKS[name](tmp)
    print(f"{name}: ok")
