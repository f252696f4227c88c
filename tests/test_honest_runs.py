"""Honest runs pass, whatever their thread count, after a resume, with states committed every K steps;
and witnessing changes nothing about the training (the probes leave every buffer as it was)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import train_tiny

from witness.bundle.reader import open_bundle
from witness.bundle.state import state_hash, state_tensors
from witness.commit.signing import generate_key
from witness.errors import RunRejected
from witness.record import Commitments, Recorder, Training
from witness.session import TrainingSession, cpu_cores
from witness.task import build_task
from witness.verify import Evidence, Policy, Verifier
from witness.verify.challenges import draw_challenges
from witness.verify.respond import respond

ALL = 10_000
CNN = {"steps": 24}


@pytest.fixture(autouse=True)
def keep_thread_count():
    """A recorder sets the process's thread count for its run; give the next test its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _both_modes(bundle, tmp_path):
    """Every step challenged offline, and interactively with the trainer's own response."""
    offline = Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    respond(bundle, tmp_path / "resp", nonce=b"r", challenges=ALL)
    interactive = Verifier(policy=Policy(challenges=ALL, nonce=b"r", mode="interactive")).verify(
        bundle, Evidence(response=tmp_path / "resp"))
    return offline, interactive


@pytest.mark.parametrize("threads", [1, 2])
def test_honest_runs_pass_at_their_own_thread_count(tmp_path, threads):
    assert cpu_cores() >= 2, "this test needs two cores (CI has them)"
    task = build_task("tinycnn", CNN)
    Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x03" * 32, commit=Commitments(checkpoint_every=8),
                    training=Training(threads=threads)).train(progress=False)
    for v in _both_modes(tmp_path / "b", tmp_path):
        assert v.accepted and v.exact and v.threads == threads and v.replayed_steps == CNN["steps"]
        assert not any("thread" in n for n in v.notes)
    # The first convolution's gradients depend on the thread count: at the other count replay
    # differs in the last bits, and the verdict says why.
    with pytest.raises(RunRejected) as info:
        Verifier(policy=Policy(challenges=ALL, threads=3 - threads)).verify(tmp_path / "b")
    assert f"(replayed at {3 - threads} thread(s); the run recorded {threads})" in info.value.failures[0]
    assert any(f"verify with --threads {threads}" in n for n in info.value.verdict.notes)


def test_a_resumed_run_passes_and_equals_an_uninterrupted_one(tmp_path):
    key = generate_key()
    task = build_task("tinycnn", CNN)
    whole = Recorder.create(task, tmp_path / "whole", key, r=b"\x04" * 32, commit=Commitments(checkpoint_every=8),
                            training=Training(threads=2))
    whole.train(progress=False)
    rec = Recorder.create(build_task("tinycnn", CNN), tmp_path / "b", key, r=b"\x04" * 32,
                          commit=Commitments(checkpoint_every=8), training=Training(threads=2))
    for t in range(19):  # killed after step 18: the records of 16..18 are unsigned
        rec.log_step(t, rec.task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    del rec
    torch.set_num_threads(1)  # a resume takes the run's own thread count back
    resumed = Recorder.resume(tmp_path / "b", key)
    assert resumed.start_step == 16 and torch.get_num_threads() == 2
    resumed.train(progress=False)
    assert open_bundle(tmp_path / "b").end.final_state_hash == open_bundle(tmp_path / "whole").end.final_state_hash
    for v in _both_modes(tmp_path / "b", tmp_path):
        assert v.accepted and v.replayed_steps == CNN["steps"]


def test_probes_leave_every_buffer_untouched(tmp_path):
    task = build_task("tinycnn", CNN)
    session = TrainingSession(task, b"\x05" * 32, len(task.dataset()))
    ds = task.dataset()
    for t in range(3):
        session.step(t, [ds.sample_bytes(i) for i in session.batch_indices(t)])
    model = session.model
    assert model.training and float(model.bn1.running_mean.abs().sum()) > 0
    before = state_hash(state_tensors(model, session.optimizer), "sha256")
    session.fingerprint()
    session.sketch()
    assert state_hash(state_tensors(model, session.optimizer), "sha256") == before
    assert all(m.training for m in model.modules())  # every module's mode is restored
    # (the hazard: a probe forward in train mode folds the probe batch into the running statistics)
    with torch.no_grad():
        task.probe_outputs(model, task.probe_tensors())
    assert state_hash(state_tensors(model, session.optimizer), "sha256") != before


def test_witnessing_changes_nothing_about_the_training(tmp_path):
    bundle = train_tiny(tmp_path / "b", task="tinycnn", config=CNN, checkpoint_every=8)
    m = open_bundle(bundle).manifest
    task = build_task("tinycnn", m.task_config)
    session = TrainingSession(task, m.run_seed, m.dataset_size)  # a plain loop: no probes, no recorder
    ds = task.dataset()
    for t in range(CNN["steps"]):
        session.step(t, [ds.sample_bytes(i) for i in session.batch_indices(t)])
    final = state_hash(state_tensors(session.model, session.optimizer), m.state_digest)
    assert final == open_bundle(bundle).end.final_state_hash


def test_a_state_committed_every_k_steps_is_replayed_segment_by_segment(tmp_path):
    # The whole state is committed every 5 steps: a challenge replays its whole segment, from the
    # committed state before it to the one after it, so a forgery inside a segment is caught by a
    # challenge on any of the segment's steps.
    def cheat(rec, t, batch):
        out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t == 7:  # the state after step 7 is not committed; the one after step 9 is
            with torch.no_grad():
                for p in rec.model.parameters():
                    rec.optimizer.state[p]["exp_avg"] += 0.01
        return out

    bundle = train_tiny(tmp_path / "b", config={"steps": 20}, checkpoint_every=10, state_every=5, cheat=cheat)
    b = open_bundle(bundle)
    assert [r.step for r in b.steps if r.state_hash] == [4, 9, 14, 19] and b.manifest.state_every == 5
    # The draws depend on the freshly signed head: at least 12 nonces, and on until some drew the
    # forged segment and some did not (12 fixed nonces all missed it once in about 1,200 runs).
    outcomes, kinds = set(), set()
    for seed in range(1 << 16):
        if seed >= 12 and len(kinds) == 2:
            break
        nonce = seed.to_bytes(2, "big")
        drawn = [c.step for c in draw_challenges(b.final_head, nonce, 20, 2)]
        segments = {s // 5 for s in drawn}
        kinds.add(1 in segments)
        respond(bundle, tmp_path / f"r{seed}", nonce=nonce, challenges=2)
        try:
            v = Verifier(policy=Policy(challenges=2, nonce=nonce, mode="interactive")).verify(bundle, Evidence(response=tmp_path / f"r{seed}"))
        except RunRejected as e:
            assert 1 in segments, (drawn, e.failures)
            assert e.verdict.results[0].step in range(5, 10) or e.verdict.results[1].step in range(5, 10)
            outcomes.add("rejected")
            continue
        outcomes.add("accepted")
        assert 1 not in segments, drawn
        assert v.replayed_steps == 5 * len(segments) and v.state_every == 5  # the cost counts whole segments
        assert "committed every 5 steps" in v.summary()
    assert outcomes == {"accepted", "rejected"}


def test_thread_counts_are_bounded_to_the_machine(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "witness.cli", *args], capture_output=True, text=True)

    too_many = str(cpu_cores() + 1)
    res = cli("train", "--task", "tiny", "--out", str(tmp_path / "b"), "--key", str(tmp_path / "k.pem"),
              "--threads", too_many, "--quiet")
    assert res.returncode == 2 and "core(s)" in res.stderr and "Traceback" not in res.stderr
    bundle = train_tiny(tmp_path / "ok", config={"steps": 4}, checkpoint_every=2)
    res = cli("verify", "--allow-weak", str(bundle), "--threads", too_many)
    assert res.returncode == 2 and "core(s)" in res.stderr and "Traceback" not in res.stderr
