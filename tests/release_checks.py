"""Replays what older releases recorded (``tests/data/release-<version>``) with this release.

Run by ``test_releases.py`` in a process of its own, whose CPU kernels it pins:
``python release_checks.py CHECK RELEASE TMPDIR`` prints ``CHECK RELEASE: ok`` or fails with an
AssertionError.

Bit-exact replay needs the recording kind of CPU: even with ATen's, MKL's and oneDNN's AVX2 paths
pinned, an Intel CPU computes a tinygpt step's gradients with other last bits than the AMD one
that recorded 0.3.0 (measured: the loss agrees, the gradient norm does not). So each check replays
bit for bit where this CPU is of the recording vendor, and elsewhere holds the run to what another
CPU can show: the same recipe, probes, data and initial state exactly, the exact verifier's refusal
(unusable, or a rejection where the run did not record its CPU), and every step within the
tolerance thresholds.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from witness.bundle.reader import open_bundle
from witness.bundle.schema import Manifest, StepRecord
from witness.bundle.state import state_hash, state_tensors
from witness.cli import main
from witness.commit.hashing import parse_canonical_json
from witness.data.dataset import batch_root, sample_hash
from witness.errors import MalformedInput, VerificationError
from witness.fingerprint.probes import relative_distance
from witness.session import TrainingSession, cpu_kernels, device_info, same_hardware
from witness.task import build_task
from witness.verify import Policy, Verifier
from witness.verify.replay import DEFAULT_THRESHOLDS

DATA = Path(__file__).parent / "data"
# The vendor of the CPU each release's records were made on (the README of each folder says more);
# 0.3.0 did not record it in its manifests.
RECORDED_ON = {"0.3.0": "AuthenticAMD", "0.4.0": "GenuineIntel"}


def exact_here(release: str, manifest: Manifest) -> bool:
    """Whether this CPU replays ``release``'s runs bit for bit: the verifier's own rule where the run
    names its CPU's kernels, else (0.3.0) a CPU of the recording vendor."""
    if "kernels" in manifest.device:
        return same_hardware(manifest.device, device_info("cpu"))
    return cpu_kernels().split()[0] == RECORDED_ON[release]


def bundle_verifies(tmp: Path, release: str) -> None:
    """The whole tiny bundle verifies, every step replayed: bit for bit on the recording kind of CPU
    (also through the CLI), else in tolerance mode once exact replay is refused."""
    bundle = tmp / "b"
    shutil.copytree(DATA / f"release-{release}" / "tiny", bundle)
    opened = open_bundle(bundle)
    assert opened.manifest.code_version == release
    steps = len(opened.steps)
    if exact_here(release, opened.manifest):
        v = Verifier(policy=Policy(challenges=steps, nonce=b"every step")).verify(opened)
        assert v.accepted and v.complete and v.replayed_steps == steps, v
        if "kernels" not in opened.manifest.device:
            assert any("did not record its CPU's kernel choice" in n for n in v.notes), v.notes
        assert main(["verify", "--allow-weak", str(bundle), "--challenges", str(steps)]) == 0
        return
    try:
        Verifier(policy=Policy(challenges=steps, nonce=b"every step")).verify(opened)
        raise AssertionError("exact replay on another kind of CPU was accepted")
    except MalformedInput as e:  # the run names its CPU: exact replay is refused, with the way out
        assert "kernels" in opened.manifest.device and "--tolerance" in str(e), e
    except VerificationError:  # a run before 0.4 did not record its CPU: the verifier tried, and the bits differ
        assert "kernels" not in opened.manifest.device
    v = Verifier(policy=Policy(challenges=steps, nonce=b"every step", exact=False)).verify(opened)
    assert v.accepted and v.replayed_steps == steps and not v.exact, v
    assert main(["verify", "--allow-weak", str(bundle), "--challenges", str(steps), "--tolerance"]) == 0


def tinygpt_step_is_the_same(tmp: Path, release: str) -> None:
    """The tinygpt recipe builds the same task and initial state, and its step 0 gives the same bits
    (on another kind of CPU: the same loss, and the rest within the tolerance thresholds)."""
    doc = json.loads((DATA / f"release-{release}" / "tinygpt-step0.json").read_text())
    manifest = Manifest.parse(parse_canonical_json(doc["log"][0].encode()))
    record = StepRecord.parse(parse_canonical_json(doc["log"][1].encode()), "step 0")
    assert manifest.code_version == release and manifest.task == "tinygpt"
    task = build_task(manifest.task, manifest.task_config)
    assert task.config_json() == manifest.task_config  # still the canonical form of the recipe
    assert task.probe_hash() == manifest.probe_hash
    assert task.fingerprint_spec() == manifest.raw["fingerprint_spec"]
    torch.set_num_threads(manifest.threads)  # as a verifier replays: at the run's thread count
    session = TrainingSession(task, manifest.run_seed, manifest.dataset_size)
    assert state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest) == manifest.init_state_hash
    assert session.batch_indices(0) == list(record.batch)
    samples = [bytes.fromhex(s) for s in doc["samples"]]
    assert batch_root([sample_hash(s) for s in samples]) == record.batch_root  # the run's own batch
    out = session.step(0, samples)
    assert out.loss == record.loss and session.lr(0) == record.lr
    fp = session.fingerprint()
    if exact_here(release, manifest):
        assert fp.digest == record.digest.hex()
        assert tuple(session.sketch()) == record.sketch
        assert state_hash(state_tensors(session.model, session.optimizer), manifest.state_digest) == record.state_hash
        return
    assert relative_distance([out.grad_norm], [record.grad_norm]) <= DEFAULT_THRESHOLDS["update"]
    assert relative_distance(fp.vector(), record.fingerprint_vector) <= DEFAULT_THRESHOLDS["fingerprint"]
    assert relative_distance(session.sketch(), record.sketch) <= DEFAULT_THRESHOLDS["sketch"]


CHECKS = {f.__name__: f for f in (bundle_verifies, tinygpt_step_is_the_same)}

if __name__ == "__main__":
    name, release, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    CHECKS[name](tmp, release)
    print(f"{name} {release}: ok")
