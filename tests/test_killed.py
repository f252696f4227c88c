"""A run killed with SIGKILL verifies as the shorter run it was, and resumes without breaking the log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from witness.bundle.reader import open_bundle
from witness.commit.signing import generate_key, save_key
from witness.verify import verify_bundle

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
    verdict = verify_bundle(out, challenges=5, nonce=b"k")
    assert verdict.accepted and not verdict.complete
    assert verdict.steps % EVERY == 0 and 100 - EVERY <= verdict.steps < STEPS
    assert any("incomplete run" in n for n in verdict.notes)
    heads_before = (out / "heads.jsonl").read_bytes()

    # Resume from the last intact checkpoint: the old signed heads stay a prefix of the new ones.
    res = subprocess.run(_train(out, key, "--resume"), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (out / "heads.jsonl").read_bytes().startswith(heads_before)
    done = verify_bundle(out, challenges=5, nonce=b"k2")
    assert done.accepted and done.complete and done.steps == STEPS

    # Same seed, same bits: the resumed run ends in exactly the state of an uninterrupted run.
    straight = tmp_path / "straight"
    res = subprocess.run(_train(straight, key), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert open_bundle(out).end.final_state_hash == open_bundle(straight).end.final_state_hash
