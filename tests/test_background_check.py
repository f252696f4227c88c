"""The self-check's sampled steps, replayed in the background by a checker process: an honest run
passes them, a loop that stops replaying at a later step is stopped before a tree head signs that
step, the cost stays within its budget, and a checker that cannot run leaves an honest run alone."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from witness.cli import main
from witness.cli.run import SELF_CHECK_SHARE
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder, SelfChecking, Training
from witness.record import background as bg
from witness.record.selfcheck import SelfCheck, SelfCheckFailed
from witness.task import build_task
from witness.task.base import StepOutput, clip_whole


def _recorder(tmp_path, steps=8, sampled=(3, 5, 6), task="tiny", **config):
    rec = Recorder.create(build_task(task, {"steps": steps, **config}), tmp_path / "run", generate_key(),
                          r=b"\x05" * 32, commit=Commitments(checkpoint_every=4))
    rec.self_check.close()
    rec.self_check = SelfCheck(rec, [0, 1], sampled=set(sampled))  # these steps, whatever they cost
    rec.self_check.prepare(0)  # (create prepared its own self-check's step 0)
    return rec


def _own_loop(rec, nudge_at=None):
    """A loop of the user's own: the task's step, except that it nudges a weight after step ``nudge_at``."""
    task = rec.task
    for t in range(task.config.steps):
        batch = rec.batch(t)
        for g in rec.optimizer.param_groups:
            g["lr"] = rec.lr(t)
        rec.optimizer.zero_grad(set_to_none=True)
        rec.model.train()
        loss = task.step_loss(rec.model, batch, rec.step_seed(t))
        loss.backward()
        gn = clip_whole([p for p in rec.model.parameters() if p.grad is not None], task.config.grad_clip)
        rec.optimizer.step()
        if t == nudge_at:  # a loop that changes after its warm-up (an EMA, a hook, a schedule of its own)
            with torch.no_grad():
                next(rec.model.parameters()).view(-1)[0] += 1e-4
        rec.log_step(t, StepOutput(float(loss.detach()), rec.lr(t), float(gn)))
    return rec.finish()


def _signed_sizes(run) -> list[int]:
    return [json.loads(line)["size"] for line in (run / "heads.jsonl").read_text().splitlines()]


def test_an_honest_run_passes_its_sampled_steps_and_verifies(tmp_path, capsys):
    rec = _recorder(tmp_path)
    rec.train(progress=False)
    r = rec.self_check.report()
    assert r["steps"] == [0, 1] and r["background"]["steps"] == [3, 5, 6]
    assert r["background"]["seconds"] > 0 and r["background"]["unavailable"] is None
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "3 sampled step(s) replayed in the background (3, 5, 6;" in line and "budget 1 %" in line
    assert rec.self_check.background.proc is None and rec.self_check.background.folder is None  # closed, cleaned
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "8", "--json"]) == 0


def test_a_loop_that_stops_replaying_later_is_stopped_before_a_head_signs_that_step(tmp_path):
    rec = _recorder(tmp_path, steps=12, sampled=(5,))
    with pytest.raises(SelfCheckFailed) as e:
        _own_loop(rec, nudge_at=5)
    message = str(e.value)
    assert message.startswith("step 5 does not replay: after it, the parameter or buffer ")
    assert "background self-check replayed sampled step 5" in message and "before its next tree head" in message
    # heads: the manifest's, then the checkpoint after step 3 (size 5); none at or after step 5's record
    sizes = _signed_sizes(tmp_path / "run")
    assert sizes and max(sizes) <= 1 + 5, sizes
    assert rec.self_check.background.proc is None  # the checker is gone
    # the bundle keeps what its heads signed and nothing after: no unsigned record of step 5 or later,
    # no checkpoint after it, so --resume cannot continue (and sign) from the step that did not replay
    log = (tmp_path / "run" / "log.jsonl").read_bytes().splitlines()
    assert len(log) == max(sizes)
    assert all(int(f.name.split(".")[0]) <= max(sizes) - 1 for f in (tmp_path / "run" / "checkpoints").iterdir())
    resumed = Recorder.resume(tmp_path / "run", rec.key)  # honest from the last signed checkpoint on
    resumed.train(progress=False)
    assert main(["verify", str(tmp_path / "run"), "--challenges", "12", "--json"]) == 0


def test_the_same_loop_unchecked_is_signed_and_then_rejected(tmp_path, capsys):
    rec = _recorder(tmp_path, steps=12, sampled=())
    _own_loop(rec, nudge_at=5)  # step 5 was not sampled: nothing stopped it
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "run"), "--challenges", "12", "--json"]) == 1
    assert '"verdict": "rejected"' in capsys.readouterr().out


def test_a_short_run_starts_no_checker_and_says_why(tmp_path, capsys):
    rec = Recorder.create(build_task("tiny", {"steps": 60}), tmp_path / "run", generate_key(), r=b"\x06" * 32)
    rec.train(progress=False)
    b = rec.self_check.background
    assert b.started_at is None and b.report()["steps"] == []
    assert "sampled steps in the background: none (a checker's start" in capsys.readouterr().err


def test_the_command_line_share_is_the_recorders_default_and_0_turns_it_off(tmp_path, capsys):
    assert SELF_CHECK_SHARE == bg.DEFAULT_SHARE
    assert main(["train", "--task", "tiny", "--steps", "4", "--out", str(tmp_path / "a"), "--key",
                 str(tmp_path / "k.pem"), "--quiet", "--self-check-share", "0"]) == 0
    assert "sampled steps in the background: off (a share of 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--task", "tiny", "--out", str(tmp_path / "b"), "--self-check-share", "1.5"])
    assert "must lie in [0, 1]" in capsys.readouterr().err


def test_a_checker_that_cannot_run_leaves_an_honest_run_alone_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bg.sys, "executable", "/bin/false")  # a checker that stops at once
    rec = _recorder(tmp_path, sampled=(3, 5))
    rec.train(progress=False)
    err = capsys.readouterr().err
    assert "warning: the background self-check is off for the rest of this run: the checker stopped" in err
    assert rec.self_check.background.report()["steps"] == []
    assert len(_signed_sizes(tmp_path / "run")) >= 3  # manifest, checkpoints, final: the run went on


def test_an_interrupted_loop_stops_its_checker_and_removes_its_scratch_states(tmp_path):
    rec = _recorder(tmp_path, sampled=(3,))
    with pytest.raises(KeyboardInterrupt), rec.stopped_on_failure():
        for t in range(5):
            out = rec.task.train_step(rec.step_model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t))
            rec.log_step(t, out)
            if t == 3:
                folder = rec.self_check.background.folder
                assert folder is not None and folder.exists()
                raise KeyboardInterrupt
    assert rec.self_check.background.proc is None and not folder.exists()


def _fake(step_seconds: float, steps: int = 100_000, start: int = 0):
    task = types.SimpleNamespace(config=types.SimpleNamespace(steps=steps))
    return types.SimpleNamespace(step_seconds=step_seconds, start_step=start, task=task)


def test_the_budget_samples_nothing_until_the_checker_start_is_earned_then_keeps_the_share():
    b = bg.BackgroundCheck.__new__(bg.BackgroundCheck)  # its sampling rule alone, on a made-up clock
    b.rec, b.share, b.forced, b.proc, b.ready = _fake(0.0), 0.01, None, None, False
    b.parent_seconds = b.child_seconds = 0.0
    b.job_estimate, b.countdown = None, None
    step_time, chosen = 0.05, []
    for t in range(1, 40_001):
        b.rec.step_seconds = t * step_time
        if b._chosen(t):
            chosen.append(t)
            if b.proc is None:  # started: its start measured at the estimate, then each job at 0.2 s
                b.proc, b.ready, b.child_seconds = object(), True, bg.START_ESTIMATE
            b.child_seconds += 0.2
            b.job_estimate = 0.2
    # the start (3 s) plus a job fits 1 % of the steps' time only after about 320 s, here step 6,400
    assert chosen and chosen[0] >= (bg.START_ESTIMATE + 2 * step_time) / 0.01 / step_time
    spent = bg.START_ESTIMATE + 0.2 * len(chosen)
    assert spent <= 0.01 * 40_000 * step_time  # never over the budget
    assert len(chosen) >= 0.9 * (0.01 * 40_000 * step_time - bg.START_ESTIMATE) / 0.2  # and it spends it
    gaps = {b2 - a for a, b2 in zip(chosen, chosen[1:], strict=False)}
    assert len(gaps) > 3  # at random places, not every n-th step


def test_a_share_outside_0_and_1_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"a fraction in \[0, 1\]"):
        Recorder.create(build_task("tiny", {"steps": 2}), tmp_path / "r", generate_key(), r=b"\x07" * 32,
                        self_check=SelfChecking(share=2.0))


def test_the_checker_reads_its_samples_file_strictly(tmp_path):
    from witness.record.background import read_samples, write_samples

    path = tmp_path / "s.bin"
    write_samples(path, [b"a", b"", b"xyz" * 10])
    assert read_samples(path) == [b"a", b"", b"xyz" * 10]
    raw = path.read_bytes()
    for bad in (raw[:-1], raw + b"\0", raw[:4]):
        path.write_bytes(bad)
        with pytest.raises(ValueError):
            read_samples(path)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


# --- what a dishonest or unlucky loop tried (the review of the background check) ----------------

def _loop_with(rec, *, after_log=None, before_step=None, catch=False, stop_at=None):
    """The task's step in a loop of the user's own; ``after_log(t)`` runs after step t's record,
    ``before_step(t)`` before its forward; ``catch`` goes on after a SelfCheckFailed (once)."""
    task, caught = rec.task, []
    for t in range(task.config.steps if stop_at is None else stop_at):
        try:
            batch = rec.batch(t)
            if before_step:
                before_step(t)
            out = task.train_step(rec.step_model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
            rec.log_step(t, out)
        except SelfCheckFailed as e:
            if not catch or caught:
                raise
            caught.append(e)
            continue
        if after_log:
            after_log(t)
    return rec.finish()


def _clamp_from(step: int, rec):
    def after_log(t):
        if t >= step:  # after the record, before the next batch: the committed state is not what trains on
            with torch.no_grad():
                next(rec.model.parameters()).clamp_(-0.01, 0.01)
    return after_log


@pytest.mark.parametrize("sampled", [(), (6,)])
def test_weights_changed_after_a_record_are_caught_where_the_next_step_is_checked(tmp_path, sampled):
    rec = Recorder.create(build_task("tiny", {"steps": 12}), tmp_path / "run", generate_key(), r=b"\x08" * 32,
                          commit=Commitments(checkpoint_every=4))
    rec.self_check.close()
    rec.self_check = SelfCheck(rec, [0, 6] if not sampled else [0], sampled=set(sampled))
    rec.self_check.prepare(0)
    with pytest.raises(SelfCheckFailed, match="step 6 does not replay"):
        _loop_with(rec, after_log=_clamp_from(5, rec))
    assert max(_signed_sizes(tmp_path / "run")) <= 1 + 6


def test_a_state_whose_layout_changes_after_warm_up_stops_the_run(tmp_path):
    rec = _recorder(tmp_path, steps=12, sampled=(6,))

    def grow(t):
        if t == 5:
            rec.model.register_buffer("ema", torch.zeros(3))  # a buffer of its own, after warm-up
    with pytest.raises(SelfCheckFailed, match="model.ema is in your state only|does not fit the task's model"):
        _loop_with(rec, after_log=grow)
    assert max(_signed_sizes(tmp_path / "run")) <= 1 + 6


def test_a_loop_that_catches_the_failure_and_goes_on_signs_nothing_after_it(tmp_path):
    rec = _recorder(tmp_path, steps=12, sampled=(5,))
    with pytest.raises(SelfCheckFailed, match="step 5 does not replay"):
        _own_loop_catching(rec)
    assert max(_signed_sizes(tmp_path / "run")) <= 1 + 5


def _own_loop_catching(rec):
    task = rec.task
    failed = None
    for t in range(task.config.steps):
        try:
            batch = rec.batch(t)
            for g in rec.optimizer.param_groups:
                g["lr"] = rec.lr(t)
            rec.optimizer.zero_grad(set_to_none=True)
            loss = task.step_loss(rec.model, batch, rec.step_seed(t))
            loss.backward()
            gn = clip_whole([p for p in rec.model.parameters() if p.grad is not None], task.config.grad_clip)
            rec.optimizer.step()
            if t == 5:
                with torch.no_grad():
                    next(rec.model.parameters()).view(-1)[0] += 1e-4
            rec.log_step(t, StepOutput(float(loss.detach()), rec.lr(t), float(gn)))
        except SelfCheckFailed as e:
            if failed is not None:
                raise  # raised again: the failure is kept
            failed = e  # a loop that shrugs it off once
    return rec.finish()


def test_a_thread_count_changed_after_create_stops_the_run(tmp_path):
    before = torch.get_num_threads()
    try:
        rec = Recorder.create(build_task("tiny", {"steps": 6}), tmp_path / "run", generate_key(), r=b"\x0a" * 32,
                              training=Training(threads=2))
        torch.set_num_threads(1)
        with pytest.raises(SelfCheckFailed, match="ran at 1 thread.*the run recorded 2"):
            rec.train(progress=False)
    finally:
        torch.set_num_threads(before)


def test_a_resumed_run_is_self_checked_too(tmp_path):
    key = generate_key()
    task = build_task("tiny", {"steps": 12})
    rec = Recorder.create(task, tmp_path / "run", key, r=b"\x0b" * 32, commit=Commitments(checkpoint_every=4))
    for t in range(6):  # killed after step 5
        rec.log_step(t, task.train_step(rec.step_model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    rec.self_check.close()
    resumed = Recorder.resume(tmp_path / "run", key)
    assert resumed.self_check is not None
    t = resumed.start_step
    batch = resumed.batch(t)
    out = task.train_step(resumed.step_model, resumed.optimizer, batch, resumed.lr(t) * 1.01, resumed.step_seed(t))
    with pytest.raises(SelfCheckFailed, match="the learning rate is not the schedule's"):
        resumed.log_step(t, out)


def test_a_process_with_many_open_files_keeps_its_check(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    files = [open(tmp_path / f"f{i}", "w") for i in range(1100)]  # descriptors past select()'s 1023
    try:
        rec = _recorder(tmp_path, sampled=(3,))
        rec.train(progress=False)
        assert rec.self_check.background.report()["steps"] == [3]
    finally:
        for f in files:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_checker_that_cannot_be_started_leaves_the_run_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bg.sys, "executable", str(tmp_path / "no-python-here"))
    rec = _recorder(tmp_path, sampled=(3, 5))
    rec.train(progress=False)
    assert "background self-check is off for the rest of this run: FileNotFoundError" in capsys.readouterr().err
