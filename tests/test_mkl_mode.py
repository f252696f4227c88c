"""MKL's reproducible mode: importing witness pins it (AUTO) before the first matrix product, so a
step's bits do not depend on where its operands lie in memory; a process that multiplied matrices
first is told so. And the configuration of finding 1 (tinygpt, 3 steps, 2 threads, self-checked)
records and replays exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder, Training
from witness.session import mkl_mode
from witness.task import build_task
from witness.verify import Policy, Verifier


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_importing_witness_pins_mkls_reproducible_mode():
    out = _python("import torch; import witness.session as s; print(s.mkl_mode())")
    assert out.returncode == 0 and out.stdout.split() == ["AUTO"], out.stderr
    # a mode the user chose is theirs
    out = _python("import witness.session as s; print(s.mkl_mode())", MKL_CBWR="COMPATIBLE")
    assert out.stdout.split() == ["COMPATIBLE"], out.stderr
    assert mkl_mode() == "AUTO"  # this test process too


def test_a_process_that_multiplied_before_importing_witness_is_warned(tmp_path):
    code = ("import torch; torch.randn(64, 64) @ torch.randn(64, 64)\n"
            "from witness.commit.signing import generate_key\n"
            "from witness.record import Commitments, Recorder\n"
            "from witness.task import build_task\n"
            "from witness.session import mkl_mode\n"
            "print(mkl_mode())\n"
            f"Recorder.create(build_task('tiny', {{'steps': 2}}), {str(tmp_path / 'run')!r}, generate_key(), "
            "r=b'\\x01' * 32, commit=Commitments(checkpoint_every=2))\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["off"]
    assert "MKL multiplied matrices before witness was imported" in out.stderr
    assert "set MKL_CBWR=AUTO" in out.stderr


@pytest.mark.parametrize("seed", range(4))
def test_finding_1s_configuration_records_and_replays_exactly(tmp_path, seed):
    # `witness train --task tinygpt --steps 3 --checkpoint-every 3` at 2 threads, self-checked, then
    # every step verified: the run that once stopped at step 0 (model.tok.weight 4.84e-08 apart)
    before = torch.get_num_threads()
    try:
        rec = Recorder.create(build_task("tinygpt", {"steps": 3}), tmp_path / "run", generate_key(),
                              r=bytes([seed]) * 32, commit=Commitments(checkpoint_every=3),
                              training=Training(threads=2))
        rec.train(progress=False)
        assert 0 in rec.self_check.report()["steps"]
        v = Verifier(policy=Policy(challenges=3, nonce=b"f1")).verify(tmp_path / "run")
        assert v.accepted and v.exact and v.replayed_steps == 3
    finally:
        torch.set_num_threads(before)
