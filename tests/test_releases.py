"""Runs recorded by an older release verify under this one, exactly when the verifier's own list
says it replays them (``witness.REPLAYS_RUNS_OF``); any other release is refused, and so is a
resume that would mix two releases', torch releases' or kinds of hardware's steps in one run.

``tests/data/release-0.3.0`` and ``release-0.4.0`` hold what witness 0.3.0 (commit 06f7969) and
0.4.0 (27e2593) recorded: a whole ``tiny`` bundle each, and the manifest, first step and batch of
a ``tinygpt`` run (its corpus is the recording machine's standard library, so the batch's bytes
are stored with it). See those folders' READMEs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import edit_manifest, train_tiny

import witness
from witness.cli import main
from witness.commit.signing import generate_key
from witness.errors import MalformedInput
from witness.record import Commitments, Recorder
from witness.task import build_task
from witness.verify import Policy, Verifier


def test_this_release_replays_its_own_runs_and_those_of_0_3_0_and_0_4_0():
    assert witness.replays(witness.__version__) and witness.replays("0.3.0") and witness.replays("0.4.0")
    assert not witness.replays("0.2.0") and not witness.replays("0.1.0")


# The records were made on x86-64 CPUs whose kernels were ATen's AVX2 ones (with MKL's and
# oneDNN's AVX2 paths): 0.3.0 on an AMD CPU, 0.4.0 on an Intel one with AVX-512. Their replay pins
# the same paths: other kernels may round differently (ATen's portable ones do, test_device shows),
# and a CPU with AVX-512 would pick other ones by default. Where this CPU is of the other vendor,
# the checks replay in tolerance mode (release_checks.py says why).
SAME_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize("release", ["0.3.0", "0.4.0"])
@pytest.mark.parametrize("check", ["bundle_verifies", "tinygpt_step_is_the_same"])
def test_what_older_releases_recorded_replays(check, release, tmp_path):
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "release_checks.py"), check, release,
                        str(tmp_path)], env=dict(os.environ, **SAME_KERNELS), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == f"{check} {release}: ok", r.stdout + r.stderr


@pytest.mark.parametrize("release", ["0.2.0", "0.3.1", "1.0.0"])
def test_a_run_of_a_release_outside_the_list_is_refused(tmp_path, release):
    key = generate_key()
    bundle = train_tiny(tmp_path / "b", key, config={"steps": 4}, checkpoint_every=2)
    edit_manifest(bundle, key, code_version=release)
    with pytest.raises(MalformedInput, match=f"recorded by witness {release}; .* replays runs of 0.3.0"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)
    assert main(["verify", "--allow-weak", str(bundle), "--challenges", "1"]) == 2


@pytest.mark.parametrize("release, resumes", [("0.3.0", True), ("0.2.0", False)])
def test_a_resume_continues_only_a_run_whose_steps_this_release_reproduces(tmp_path, release, resumes):
    key = generate_key()
    task = build_task("tiny", {"steps": 8})
    rec = Recorder.create(task, tmp_path / "b", key, r=b"\x03" * 32, commit=Commitments(checkpoint_every=4))
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
    assert Verifier(policy=Policy(challenges=8, nonce=b"all")).verify(tmp_path / "b").accepted


@pytest.mark.parametrize("change", ["torch", "kernels"])
def test_a_resume_elsewhere_is_refused_before_it_touches_the_run(tmp_path, monkeypatch, change):
    # Steps from two torch releases or two kinds of CPU would replay exactly on neither.
    from witness.record import start

    key = generate_key()
    rec = Recorder.create(build_task("tiny", {"steps": 8}), tmp_path / "b", key, r=b"\x03" * 32,
                          commit=Commitments(checkpoint_every=4))
    for t in range(6):  # killed after step 5: the records of 4 and 5 are unsigned, and a resume would drop them
        rec.log_step(t, rec.task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    del rec
    before = {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    if change == "torch":
        monkeypatch.setattr(start, "torch_version", lambda: "9.9.9")
        why = "started with torch .* this is torch 9.9.9"
    else:
        other = dict(start.device_info("cpu"), kernels="GenuineIntel AVX512 avx512f")
        monkeypatch.setattr(start, "device_info", lambda device, compiled=False: other)
        why = "started on the CPU .* this is the CPU .*GenuineIntel AVX512.*: resume it on the same hardware"
    with pytest.raises(ValueError, match=why):
        Recorder.resume(tmp_path / "b", key)
    assert {p: p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()} == before  # nothing lost
    monkeypatch.undo()
    resumed = Recorder.resume(tmp_path / "b", key)
    assert resumed.start_step == 4
