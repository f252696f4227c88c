"""A run killed with SIGKILL verifies as the shorter run it was, and resumes without breaking the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from witness.bundle.reader import open_bundle
from witness.commit.signing import generate_key, save_key
from witness.errors import MalformedInput
from witness.verify import Policy, Verifier

STEPS, EVERY = 600, 20


def _train(out, key, *extra):
    return [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", str(STEPS),
            "--checkpoint-every", str(EVERY), "--seed", "killme", "--key", str(key), "--out", str(out),
            "--quiet", "--threads", "1", *extra]


def test_kill_9_then_verify_then_resume(tmp_path):
    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    out = tmp_path / "run"
    proc = subprocess.Popen(_train(out, key), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        log = out / "log.jsonl"
        if log.exists() and log.read_bytes().count(b"\n") >= 100:
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # The killed bundle verifies as the run it really was: the steps its last signed head covers.
    verdict = Verifier(policy=Policy(challenges=5, nonce=b"k")).verify(out)
    assert verdict.accepted and not verdict.complete
    assert verdict.steps % EVERY == 0 and 100 - EVERY <= verdict.steps < STEPS
    assert any("incomplete run" in n for n in verdict.notes)
    heads_before = (out / "heads.jsonl").read_bytes()

    # Resume from the last intact checkpoint: the old signed heads stay a prefix of the new ones.
    res = subprocess.run(_train(out, key, "--resume"), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (out / "heads.jsonl").read_bytes().startswith(heads_before)
    done = Verifier(policy=Policy(challenges=5, nonce=b"k2")).verify(out)
    assert done.accepted and done.complete and done.steps == STEPS

    # Same seed, same bits: the resumed run ends in exactly the state of an uninterrupted run.
    straight = tmp_path / "straight"
    res = subprocess.run(_train(straight, key), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert open_bundle(out).end.final_state_hash == open_bundle(straight).end.final_state_hash


def test_a_checkpoint_write_cut_short_is_left_aside_and_cleared_by_the_resume(tmp_path):
    from helpers import train_tiny

    from witness.record import Commitments, Recorder
    from witness.task import build_task

    key = generate_key()
    task = build_task("tiny", {"steps": 8})
    rec = Recorder.create(task, tmp_path / "b", key, r=b"\x03" * 32, commit=Commitments(checkpoint_every=4))
    for t in range(6):
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    del rec
    # what a kill leaves while safetensors writes a file through its temp file, and our own temp files
    for name in ("checkpoints/.tmpTk9udY", "checkpoints/00000008.safetensors.tmp", "checkpoints/.tmpAbC123"):
        (tmp_path / "b" / name).write_bytes(b"half a checkpoint")
    v = Verifier(policy=Policy(challenges=4, nonce=b"t")).verify(tmp_path / "b")
    assert v.accepted and not v.complete
    resumed = Recorder.resume(tmp_path / "b", key)
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp*"))
    resumed.train(progress=False)
    assert Verifier(policy=Policy(challenges=8, nonce=b"all")).verify(tmp_path / "b").complete
    # a file of that shape outside the folders a write goes to is still an unexpected file
    train_tiny(tmp_path / "c", config={"steps": 4}, checkpoint_every=2)
    (tmp_path / "c" / ".tmpTk9udY").write_bytes(b"x")
    with pytest.raises(MalformedInput, match="unexpected file"):
        open_bundle(tmp_path / "c")
