"""Online challenges: a beacon's signed randomness selects steps while the run trains, the trainer
keeps their states, and the verifier replays exactly those. Each attack is a signed, well-formed
run (or beacon exchange) whose only flaw is the dishonesty."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_binomial
from starlette.testclient import TestClient

from witness.beacon.app import create_app
from witness.beacon.client import BeaconClient, BeaconError
from witness.bundle.layout import STATEMENTS, online_samples_name, online_state_name
from witness.cli import main
from witness.commit.beacon import BeaconStatement, online_bound, run_id, selected, selected_steps
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.log import RunLog
from witness.commit.signing import (
    SignedTreeHead,
    generate_key,
    public_hex,
    public_key_from_hex,
    save_key,
)
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.record import Commitments, Online, SelfChecking
from witness.record.online import OnlineSpec
from witness.record.recorder import Recorder
from witness.task import build_task
from witness.verify import Policy, Trust, Verifier
from witness.web import start_uvicorn, stop_uvicorn

STEPS, P, EVERY = 24, 0.25, 4
SPEC = OnlineSpec(p=P, every=EVERY, ring=2 * EVERY + 1)


class Beacon:
    """A beacon app on its own SQLite file, reached in-process; ``steer`` fixes the draws."""

    def __init__(self, folder: Path):
        self.key = generate_key()
        self.app = create_app(f"sqlite:///{folder / 'beacon.db'}", self.key)
        self.http = TestClient(self.app)
        self.public_key = public_hex(self.key.public_key())

    def link(self) -> BeaconClient:
        return BeaconClient(self.http)

    def steer(self, avoid: set[int] = frozenset(), hit: set[int] = frozenset(), steps: int = STEPS) -> None:
        """Draw betas that leave the steps in ``avoid`` unselected and select those in ``hit``."""
        def draw(prev_size: int, size: int) -> bytes:
            window = range(max(prev_size - 1, 0), max(min(size - 1, steps), 0))
            while True:
                beta = os.urandom(32)
                if all(not selected(beta, t, P) for t in avoid if t in window) and \
                        all(selected(beta, t, P) for t in hit if t in window):
                    return beta
        self.app.state.beacon.draw = draw


@pytest.fixture
def beacon(tmp_path):
    return Beacon(tmp_path)


def train(out: Path, link, *, bad: set[int] = frozenset(), key=None, steps: int = STEPS, spec: OnlineSpec = SPEC,
          r: bytes = b"\x05" * 32):
    """A tiny run with online challenges; at each step in ``bad`` the trainer nudges the weights
    before training it (the committed state before the step is the honest one)."""
    task = build_task("tiny", {"steps": steps})
    rec = Recorder.create(task, out, key or generate_key(), r=r, commit=Commitments(checkpoint_every=8),
                          online=Online(beacon=link, spec=spec), self_check=SelfChecking(enabled=not bad))
    for t in range(steps):
        if t in bad:
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(0.01)
        out_ = task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t))
        rec.log_step(t, out_)
    rec.finish()
    return rec


def online(bundle, key: str, **kw):
    return Verifier(Trust(beacon_key=key), Policy(mode="online", **kw)).verify(bundle)


def statements(bundle: Path) -> list[BeaconStatement]:
    return [BeaconStatement.from_json(parse_canonical_json(x)) for x in (bundle / STATEMENTS).read_bytes().splitlines()]


# --- honest runs -----------------------------------------------------------------------------

def test_an_honest_online_run_replays_exactly_the_selected_steps_in_both_comparisons(tmp_path, beacon, capsys):
    rec = train(tmp_path / "b", beacon.link())
    sts = statements(tmp_path / "b")
    want = sorted(t for s in sts for t in selected_steps(s, P, STEPS))
    assert [s.size for s in sts] == sorted({1, *range(EVERY + 1, STEPS + 2, EVERY), 9, 17, 25, STEPS + 2})
    assert sts[-1].final and all(not s.final for s in sts[:-1])
    report = rec.online.report()
    # (training may wait for a slow beacon, under load, but never holds more than the ring)
    assert report["selected"] == len(want) and report["peak_ring"] <= SPEC.ring
    # the ring's host buffers are reused: the pool holds about the ring's worth (those of a window
    # being written wait for it, as training fills the ring again), never a buffer a step (STEPS + 1)
    assert len(rec.online._buffers._targets) <= 2 * SPEC.ring < STEPS + 1
    for exact in (True, False):
        v = online(tmp_path / "b", beacon.public_key, exact=exact)
        assert v.accepted and v.mode == "online" and v.replayed_steps == len(want)
        assert [r.step for r in v.results] == want
        assert v.online["selected"] == want and v.online["unaudited"] == 0 and v.online["final"]
        assert v.detection_probability == pytest.approx(online_bound(P, 0.05, STEPS))
        assert "1-(1-p)^ceil(fT)" in v.summary() and f"p = {P:g}" in v.summary()
    # the cheap checks still run in full, and the after-the-fact audits still work on the same bundle
    assert Verifier(policy=Policy(challenges=3)).verify(tmp_path / "b").accepted
    # the command line: the verifier names the beacon's key, or the input is unusable
    from witness.cli import main
    assert main(["verify", "--allow-weak", str(tmp_path / "b"), "--mode", "online", "--beacon-key", beacon.public_key, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["online"]["selected"] == want
    assert main(["verify", "--allow-weak", str(tmp_path / "b"), "--mode", "online"]) == 2
    assert "--beacon-key" in capsys.readouterr().err
    # inspect shows the online audit's state
    assert main(["inspect", str(tmp_path / "b"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["online"]
    assert shown["selected"] == want and shown["statements"] == len(sts) and not shown["missing"] and shown["final"]
    assert main(["inspect", str(tmp_path / "b")]) == 0
    assert f"{len(sts)} beacon statement(s) over steps 0..{STEPS - 1}, {len(want)} step(s) selected" in \
        capsys.readouterr().out
    # the beacon lists the run, ended with its final head
    runs = beacon.http.get("/api/beacon/runs").json()
    assert runs[0]["run"] == sts[0].run.hex() and runs[0]["final"] and runs[0]["last_size"] == STEPS + 2


def test_a_released_ring_buffer_is_reused_and_not_held_twice():
    from witness.record.kept import StatePool

    pool, state = StatePool(), {"a": torch.zeros(4), "b": torch.ones(2)}
    slot = pool.copy(state)
    pool.release(slot)
    assert pool.take(state) is slot  # one _foreach_copy_ into a buffer the ring already has
    assert len(pool._targets) == 1


def test_a_covered_state_leaves_the_ring_only_after_its_note_is_out(tmp_path, beacon, monkeypatch):
    """Rank 0's notes tell the other ranks which shares to free; a state rank 0 freed before noting it
    let another rank hold more than rank 0's ring (CI saw 6 against 5, over two ranks)."""
    from witness.record.online import OnlineChallenges

    seen: list[tuple[int, list[int]]] = []
    made = OnlineChallenges.__init__

    def noted(self, *a, **k) -> None:  # noqa: ANN001 - the recorder's arguments
        made(self, *a, **k)
        self.on_answer = lambda covered, needed, window: seen.append((covered, sorted(self.ring)))

    monkeypatch.setattr(OnlineChallenges, "__init__", noted)
    train(tmp_path / "b", beacon.link())
    # each note finds every state it covers since the last one still held: the ring frees them after it
    prev = 0
    for covered, held in seen:
        assert set(range(prev, covered)) <= set(held), (prev, covered, held)
        prev = max(prev, covered)
    assert prev == STEPS, seen


def test_with_the_overlapped_state_hash_the_ring_keeps_its_copy(tmp_path, beacon):
    # the GPU path, on the CPU: the hash's snapshot is copied into the ring's buffers (one copy
    # for both), and the run verifies online exactly as one copied twice
    task = build_task("tiny", {"steps": STEPS})
    rec = Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x05" * 32, commit=Commitments(checkpoint_every=8),
                          online=Online(beacon=beacon.link(), spec=SPEC))
    rec.overlap = True
    rec.train()
    r = rec.online.report()
    # states after 8, 16 and 24 updates are checkpoints (hashed inline: copied); the initial state
    # is kept before training starts; every other one came from the snapshot
    assert r["shared_copies"] > 0 and r["copies"] <= 4 and r["shared_copies"] + r["copies"] <= STEPS + 1
    v = online(tmp_path / "b", beacon.public_key)
    assert v.accepted and v.replayed_steps == r["selected"]
    for exact in (True, False):
        assert online(tmp_path / "b", beacon.public_key, exact=exact).accepted


def test_the_selection_is_a_fair_coin_of_p_per_step():
    # 4,000 fresh betas: each step is selected with probability p, independently of the others
    rng = random.Random(3)
    betas = [rng.randbytes(32) for _ in range(4000)]
    assert_binomial(sum(selected(b, 7, P) for b in betas), len(betas), P)
    both = sum(selected(b, 7, P) and selected(b, 8, P) for b in betas)
    assert_binomial(both, len(betas), P * P)
    # k bad steps escape with probability (1 - p)^k: the bound is exact for independent draws
    k = 5
    caught = sum(any(selected(b, t, P) for t in range(10, 10 + k)) for b in betas)
    assert_binomial(caught, len(betas), 1 - (1 - P) ** k)
    assert online_bound(P, 0.05, 100) == pytest.approx(1 - (1 - P) ** 5)


# --- bad steps the trainer hopes are not selected --------------------------------------------

@pytest.mark.parametrize("drawn", ["selected", "missed"])
def test_a_bad_step_is_caught_exactly_when_the_beacon_selects_it(tmp_path, beacon, drawn):
    # replay alone (a run that commits no parameter chunks): the draw decides
    bad = {9}
    beacon.steer(hit=bad) if drawn == "selected" else beacon.steer(avoid=bad)
    train(tmp_path / "b", beacon.link(), bad=bad, spec=dataclasses.replace(SPEC, chunks=0))
    if drawn == "selected":
        with pytest.raises(RunRejected, match="step 9"):
            online(tmp_path / "b", beacon.public_key)
    else:  # the draw missed it: accepted, within the stated bound (1 - p of the time for one bad step)
        v = online(tmp_path / "b", beacon.public_key)
        assert v.accepted and 9 not in v.online["selected"] and v.moves is None
        assert "bounded move not checked" in " ".join(v.notes)


def test_a_step_that_moves_a_weight_too_far_is_caught_where_no_draw_selects_it(tmp_path, beacon):
    # the same bad step (every weight nudged by 0.01 before step 9 trains) in a run that commits its
    # chunks: every step's opened coordinates are held to AdamW's bound, so the draw need not select it
    beacon.steer(avoid={8, 9})
    train(tmp_path / "b", beacon.link(), bad={9})
    with pytest.raises(RunRejected, match=r"step 9: moves: model\.\S+\[\d+(, \d+)*\] moved from .* in one step where "
                                          r"it may move") as info:
        online(tmp_path / "b", beacon.public_key)
    v = info.value.verdict
    assert 8 not in v.online["selected"] and 9 not in v.online["selected"] and len(v.failures) == 1


def _manifest(out: Path) -> dict:
    """The run's manifest (the log's first record)."""
    return json.loads((out / "log.jsonl").read_text().splitlines()[0])


def _chunked(out: Path) -> list[Path]:
    return sorted((out / "online" / "chunks").glob("*.safetensors"))


def _own_loop(out: Path, link, change, task: str = "tiny", config: dict | None = None):  # noqa: ANN001
    """An online run whose trainer calls ``change(rec, t)`` before training each step; every window
    opens all of the (small) model's chunks, so an edit in one chunk is opened whatever the draw."""
    task = build_task(task, {"steps": STEPS} | (config or {}))
    rec = Recorder.create(task, out, generate_key(), r=os.urandom(32), commit=Commitments(checkpoint_every=8),
                          online=Online(beacon=link, spec=dataclasses.replace(SPEC, chunks=8)),
                          self_check=SelfChecking(enabled=False))
    for t in range(STEPS):
        batch = rec.batch(t)
        change(rec, t)
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t)))
    rec.finish()


def test_a_coordinate_sent_to_infinity_is_out_of_bounds_but_an_honest_divergence_is_not(tmp_path, beacon):
    """A trainer kills channels of the CNN plugin by setting their BatchNorm biases to -inf at a step no
    draw selects (after the ReLU the model stays finite, and trains on): no step of AdamW takes a finite
    value to an infinite one. A run whose steps diverge honestly (a rate so large its weights overflow,
    then NaN gradients make every weight NaN) passes: NaN is an honest value where the loss is NaN."""
    def kill(rec, t):  # noqa: ANN001
        if t == 9:
            with torch.no_grad():
                rec.model[1].bias[:4] = float("-inf")

    beacon.steer(avoid={8, 9})
    _own_loop(tmp_path / "dead", beacon.link(), kill, "example-cnn")
    with pytest.raises(RunRejected, match=r"step 9: moves: model\.1\.bias\[\d\] moved from \S+ to -inf"):
        online(tmp_path / "dead", beacon.public_key)
    _own_loop(tmp_path / "diverged", beacon.link(), lambda rec, t: None, config={"lr": 1e7})
    lines = (tmp_path / "diverged" / "log.jsonl").read_text().splitlines()
    assert '"loss":"nan"' in lines[-2]  # (it did diverge)
    v = online(tmp_path / "diverged", beacon.public_key)
    assert v.accepted and v.moves["checked"] == STEPS


def test_a_kept_state_of_other_dtypes_is_rejected_not_a_crash(tmp_path, beacon, monkeypatch):
    """The trainer commits (and keeps, for the selected step 10) a state whose fc1.bias is float64: its
    hash is the committed one, its parameters do not fit the task's model."""
    import witness.record.online as online_mod
    import witness.record.records as records
    from witness.bundle.opened import StateTree as RealTree
    from witness.bundle.state import state_hash as real_hash
    from witness.record.online import OnlineChallenges

    def forged(state):  # noqa: ANN001
        return {**state, "model.fc1.bias": state["model.fc1.bias"].to(torch.float64)}

    at = {"step": None}
    real_log, real_write = Recorder.log_step, OnlineChallenges._write
    monkeypatch.setattr(records, "state_hash", lambda st, d: real_hash(forged(st) if at["step"] == 9 else st, d))
    # (where the chunks open into the state hash, the state tree is the record's hash)
    monkeypatch.setattr(online_mod, "StateTree", lambda st, d, lay, flat=None, plan=None: RealTree(forged(st), d, lay)
                        if at["step"] == 9 else RealTree(st, d, lay, flat, plan=plan))
    monkeypatch.setattr(OnlineChallenges, "state_hash", lambda self, n, d: None)  # (hashed by state_hash, above)
    monkeypatch.setattr(Recorder, "log_step", lambda self, t, out, *a, **k: (at.update(step=t),
                                                                            real_log(self, t, out, *a, **k))[1])
    monkeypatch.setattr(OnlineChallenges, "_write", lambda self, n, st: real_write(self, n, forged(st) if n == 10 else st))
    beacon.steer(hit={10}, avoid={9})
    train(tmp_path / "b", beacon.link())
    monkeypatch.undo()
    with pytest.raises(RunRejected, match="step 9: state: the state after step 9 does not fit the task's model"):
        online(tmp_path / "b", beacon.public_key)


def test_a_state_a_crash_lost_is_written_and_kept_for_the_next_windows_openings(tmp_path):
    """Resuming: the state after 8 updates was selected (it ends step 7) and lost, and the window
    before ends on it. It is written when the resumed run passes it, and kept in the ring too: the next
    window's steps go from it, so its openings open it (found by a kill -9 test, 1 run in 15)."""
    from witness.bundle.state import state_tensors
    from witness.fingerprint.chunks import ChunkLayout
    from witness.record.online import OnlineChallenges
    from witness.session import TrainingSession

    task = build_task("tiny", {"steps": STEPS})
    session = TrainingSession(task, b"\x05" * 32, len(task.dataset()))
    ring = OnlineChallenges(tmp_path, SPEC, None, RunLog(), STEPS, task.dataset(), 8,  # type: ignore[arg-type]
                            ChunkLayout.of_model(session.model, SPEC.chunk_bytes))
    ring.covered, ring.wanted = 8, {8}
    tree = ring.keep(8, state_tensors(session.model, session.optimizer))
    assert (tmp_path / online_state_name(8)).exists() and ring.rebuilt == 1 and not ring.wanted
    assert 8 in ring.ring and ring.trees[8] is tree
    ring.keep(7, state_tensors(session.model, session.optimizer))  # a covered state: hashed, not kept
    assert 7 not in ring.ring


def test_chunk_openings_left_out_moved_or_changed_are_rejected(tmp_path, beacon, monkeypatch):
    """A window's openings: every step of every window must have them, each is its window's own, and
    every byte is bound by the records' roots (a chunk, a path node), the padding zeros too."""
    train(tmp_path / "b", beacon.link(), spec=dataclasses.replace(SPEC, chunks=4))  # all four of tiny's chunks
    v = online(tmp_path / "b", beacon.public_key)
    assert v.moves["checked"] == STEPS and v.moves["windows"] == len(_chunked(tmp_path / "b")) == STEPS // EVERY
    assert 0 < v.moves["worst"] <= 1 and "every step: bounded move checked at 4 chunk(s) of 4" in v.summary()
    from witness.verify import bounded

    monkeypatch.setattr(bounded, "BATCH_BYTES", 1)  # a window a batch: the same check, the same figures
    again = online(tmp_path / "b", beacon.public_key).moves
    assert {k: again[k] for k in ("checked", "windows", "worst", "sizes")} == \
        {k: v.moves[k] for k in ("checked", "windows", "worst", "sizes")}
    monkeypatch.undo()

    def tampered(name: str, change) -> Path:  # noqa: ANN001 - what the trainer does to its copy
        out = tmp_path / name
        shutil.copytree(tmp_path / "b", out)
        change(out)
        return out

    files = _chunked(tmp_path / "b")
    gone = tampered("gone", lambda o: (o / "online" / "chunks" / files[2].name).unlink())
    with pytest.raises(RunRejected, match=r"step 8: moves: the trainer kept no chunk openings for the window "
                                          r"closing at size 13") as e:
        online(gone, beacon.public_key)
    assert e.value.verdict.moves["failed_window"] == 13
    moved = tampered("moved", lambda o: shutil.copy(o / "online" / "chunks" / files[1].name,
                                                    o / "online" / "chunks" / files[2].name))
    with pytest.raises(RunRejected, match="not the chunk openings of the window closing at size 13") as e:
        online(moved, beacon.public_key)
    assert e.value.verdict.moves["failed_window"] == 13

    def flip(o: Path, name: str, at: int) -> None:
        from safetensors.numpy import load_file

        from witness.bundle.checkpoint import safetensors_header as header
        from witness.bundle.checkpoint import save_safetensors

        path = o / "online" / "chunks" / files[1].name
        arrays = {k: torch.from_numpy(v.copy()) for k, v in load_file(str(path)).items()}
        arrays[name].view(-1)[at] ^= 1
        save_safetensors(arrays, path, header(path)["__metadata__"])

    def floats(o: Path) -> None:  # the same bytes, its header's offsets written as JSON floats (64.0 == 64)
        path = o / "online" / "chunks" / files[1].name
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name in ("chunks", "paths"):
            header[name]["data_offsets"] = [float(x) for x in header[name]["data_offsets"]]
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    with pytest.raises(MalformedInput, match="tensors are not where its header says"):
        online(tampered("floats", floats), beacon.public_key)
    path = "does not lead to the state hash its record commits"
    # (each is the first state of files[1]'s window, which the window before ends on too: the failure names the
    # window whose openings failed, not the step alone, so a leaderboard's decision names that file)
    for name, at, why in (("chunks", 5, path), ("paths", 40, path),
                          ("chunks", 1024 * 2 + 200, "fc2.bias.* holds bytes past the tensor's end")):  # its padding
        bad = tampered(f"{name}{at}", lambda o, n=name, a=at: flip(o, n, a))
        with pytest.raises(RunRejected, match=why) as e:
            online(bad, beacon.public_key)
        assert e.value.verdict.moves["failed_window"] == int(files[1].name[:8])
        assert f"failed in the window closing at size {int(files[1].name[:8])}" in e.value.verdict.summary()
    # a trainer that commits padding of its own (for states 9..15, which no draw loads): every path
    # holds, the zeros do not
    from witness.record.online import OnlineChallenges

    real_tree = OnlineChallenges.tree

    def padded(self, n, tensors):  # noqa: ANN001
        flat = self._buffers.flat(tensors)
        if flat is not None:  # (the ring reuses its buffers: the others' padding is zeros again)
            lay = self.layout
            for i in range(len(lay.tensors)):
                end = lay.starts[i + 1] if i + 1 < len(lay.tensors) else lay.size
                flat[lay.starts[i] * lay.chunk_bytes + lay.nbytes(i):end * lay.chunk_bytes] = \
                    0xAB if 9 <= n <= 15 else 0
        return real_tree(self, n, tensors)

    monkeypatch.setattr(OnlineChallenges, "tree", padded)
    beacon.steer(avoid=set(range(8, 17)))
    train(tmp_path / "padded", beacon.link(), spec=dataclasses.replace(SPEC, chunks=4), r=os.urandom(32))
    monkeypatch.undo()
    with pytest.raises(RunRejected, match="holds bytes past the tensor's end"):
        online(tmp_path / "padded", beacon.public_key)


@pytest.mark.parametrize("tree", [None, "blake3"])
def test_a_param_root_that_is_not_its_states_is_caught_where_that_state_is_loaded(tmp_path, beacon, monkeypatch, tree):
    """A trainer commits, for the state after 9 updates, the chunk root of other parameters (one
    coordinate an ulp away) and opens chunks of those: every opened move is within the bound. The
    state it keeps is the real one, whose hash the record commits: a verifier that loads it (the draw
    selects step 9) finds its chunk root is not the record's. Where no draw loads it, the divergence
    is one step the audit did not see, as a bad step is: the verdict claims nothing more. Where the
    chunks open into the state hash (version 4), the fake parameters' tree is the record's state hash,
    and the real state kept does not hash to it."""
    from witness.bundle.opened import StateTree
    from witness.record.online import OnlineChallenges, StatePool

    fakes: dict[int, torch.Tensor] = {}
    real_tree, real_flat = OnlineChallenges.tree, StatePool.flat

    def fake_tree(self, n, tensors):  # noqa: ANN001
        if n != 9:
            fakes.pop(id(tensors), None)  # the ring reuses its buffers: this one holds another state now
            return real_tree(self, n, tensors)
        flat = self.layout.flatten(tensors).clone()
        x = flat[:4].view(torch.float32)
        x[0] = torch.nextafter(x[0], torch.tensor(1.0))
        fakes[id(tensors)] = flat
        t = StateTree(tensors, "blake3", self.layout, flat) if tree else self.layout.tree(flat)
        with self._lock:
            self.trees[n] = t
        return t

    monkeypatch.setattr(OnlineChallenges, "tree", fake_tree)
    monkeypatch.setattr(StatePool, "flat", lambda self, slot: fakes.get(id(slot), real_flat(self, slot)))
    caught = r"the state after 9 update\(s\) does not hash to the committed state" if tree else \
        "step 8: moves: the record's param_root is not the chunk root of its committed state's parameters"
    for drawn in ("selected", "missed"):
        fakes.clear()  # (a buffer of the run before may have the id of one of this run's)
        beacon.steer(hit={9}) if drawn == "selected" else beacon.steer(avoid={8, 9})
        train(tmp_path / drawn, beacon.link(), r=os.urandom(32), spec=dataclasses.replace(SPEC, tree=tree))
        assert _manifest(tmp_path / drawn)["format_version"] == (4 if tree else 3)
        if drawn == "selected":
            with pytest.raises(RunRejected, match=caught):
                online(tmp_path / drawn, beacon.public_key)
        else:
            v = online(tmp_path / drawn, beacon.public_key)
            assert v.accepted and v.moves["checked"] == STEPS


def test_every_mode_holds_each_state_it_loads_or_reaches_to_its_records_param_root(tmp_path, beacon):
    """Re-signed logs (the trainer holds its key): a param_root that is not its state's is found by
    offline replay where it reaches that state, and at a checkpoint by the cheap checks; a record
    without one, or a run that names none, is refused as it is read."""
    from helpers import log_lines

    key = generate_key()
    train(tmp_path / "b", beacon.link(), key=key, spec=dataclasses.replace(SPEC, tree=None))  # as recorded before
    lines = log_lines(tmp_path / "b")
    forged = _forger(tmp_path, "b", key, lines)

    other = parse_canonical_json(lines[5])["param_root"]
    swapped = forged("swapped", 6, lambda o: o.update(param_root=other))  # step 5 names step 4's root
    with pytest.raises(RunRejected, match="step 5: moves: the record's param_root is not the chunk root"):
        Verifier(policy=Policy(challenges=10_000, nonce=b"all")).verify(swapped)
    at_checkpoint = forged("checkpoint", 8, lambda o: o.update(param_root=other))  # step 7: a checkpoint
    with pytest.raises(VerificationError, match="its record's param_root is not the chunk root of its parameters"):
        Verifier(policy=Policy(challenges=1)).verify(at_checkpoint)
    none = forged("none", 3, lambda o: o.pop("param_root"))
    with pytest.raises(VerificationError, match="step 2: record: the record lacks a param_root"):
        Verifier(policy=Policy(challenges=1)).verify(none)
    from witness.bundle.schema import Manifest

    m = parse_canonical_json(lines[0])
    for change, why in (({"format_version": 2}, "version 3 is an online run's that commits"),
                        ({"online": {k: v for k, v in m["online"].items() if k != "chunks"}}, "come together"),
                        ({"online": m["online"] | {"chunk_bytes": 1000}}, "power of two"),
                        ({"online": m["online"] | {"chunks": 0}}, "online.chunks"),
                        ({"online": m["online"] | {"chunks": 256, "chunk_bytes": 1 << 20}}, "may hold at most 256 MiB")):
        with pytest.raises(MalformedInput, match=why):
            Manifest.parse(m | change)


def _forger(tmp_path: Path, name: str, key, lines: list[bytes]):  # noqa: ANN001
    """``forged(name, record, change)``: a copy of the bundle ``name`` whose log record ``record`` is
    changed in place and re-signed with the trainer's key."""
    from helpers import resign

    def forged(new: str, record: int, change) -> Path:  # noqa: ANN001
        out = tmp_path / new
        shutil.copytree(tmp_path / name, out)
        edited = list(lines)
        obj = parse_canonical_json(edited[record])
        change(obj)
        edited[record] = canonical_json(obj)
        resign(out, key, edited)
        return out

    return forged


def test_state_leaves_bind_where_each_opened_leaf_lies(tmp_path, beacon):
    """Version 4 (the chunks open into the state hash): re-signed logs whose records name another count of
    the state tree's leaves than the state replay reaches or loads are rejected there (their openings, in
    tests/test_opened.py); a record without
    state_leaves, or with a param_root, is refused as it is read, and so is a manifest that mixes the formats."""
    from helpers import log_lines

    from witness.bundle.schema import Manifest

    key = generate_key()
    train(tmp_path / "b", beacon.link(), key=key)
    lines = log_lines(tmp_path / "b")
    m = parse_canonical_json(lines[0])
    assert m["format_version"] == 4 and m["online"]["tree"] == "blake3" and m["online"]["hashed_by"] == "host"
    rec = parse_canonical_json(lines[6])
    assert "param_root" not in rec and rec["state_leaves"] > 0
    forged = _forger(tmp_path, "b", key, lines)
    more = forged("more", 6, lambda o: o.update(state_leaves=o["state_leaves"] + 1))  # step 5
    with pytest.raises(RunRejected, match="step 5: state: the record commits a state of 17 tensors, and its state "
                                          "holds 16"):  # replay reaches the state after step 5
        Verifier(policy=Policy(challenges=10_000, nonce=b"all")).verify(more)
    with pytest.raises(VerificationError, match="its record commits a state of .* tensors, and it holds"):
        Verifier(policy=Policy(challenges=1)).verify(forged("checkpoint", 8, lambda o: o.update(state_leaves=3)))
    with pytest.raises(VerificationError, match="step 2: record: the record lacks state_leaves"):
        Verifier(policy=Policy(challenges=1)).verify(forged("none", 3, lambda o: o.pop("state_leaves")))
    with pytest.raises(VerificationError, match="step 2: record: the record adds a param_root"):
        Verifier(policy=Policy(challenges=1)).verify(forged("root", 3, lambda o: o.update(param_root="00" * 32)))
    for change, why in (({"format_version": 3}, "version 3 is an online run.s that commits its parameters. chunks .* in a param_root"),
                        ({"online": m["online"] | {"chunk_bytes": 2048}}, "chunk_bytes must be 1024"),
                        ({"online": {k: v for k, v in m["online"].items() if k != "hashed_by"}}, "come together"),
                        ({"online": m["online"] | {"hashed_by": "tpu"}}, "hashed_by must be host or cuda"),
                        ({"online": m["online"] | {"tree": "sha256"}}, "online.tree must be 'blake3'"),
                        ({"state_digest": "sha256"}, "hashes its states with BLAKE3")):
        with pytest.raises(MalformedInput, match=why):
            Manifest.parse(m | change)


def test_the_command_line_opens_the_recorders_default_chunks_and_k_reaches_the_manifest(capsys):
    from witness.cli import build_parser
    from witness.cli.run import ONLINE_CHUNKS, _online_spec
    from witness.record.online import DEFAULT_CHUNKS

    assert ONLINE_CHUNKS == DEFAULT_CHUNKS  # what --online-chunks's help says is the default
    parse = build_parser().parse_args
    base = ["train", "--task", "tiny", "--beacon", "http://127.0.0.1:9"]
    assert _online_spec(parse(base), 100).chunks == DEFAULT_CHUNKS
    assert _online_spec(parse(base + ["--online-chunks", "5"]), 100).to_json()["chunks"] == 5
    assert "chunks" not in _online_spec(parse(base + ["--online-chunks", "0"]), 100).to_json()  # none committed
    for bad in ("-1", "257", "two"):
        with pytest.raises(SystemExit):
            parse(base + ["--online-chunks", bad])
    assert "--online-chunks" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_a_plugin_run_commits_its_chunks_where_its_optimizer_bounds_a_move(tmp_path, beacon, capsys, optimizer):
    # the example plugin (a BatchNorm CNN): with AdamW every step's move is checked; with SGD, whose
    # momentum sums gradients that nothing bounds, the recorder says the check is off and commits no
    # chunks (a manifest of version 2), and the verdict says the check was not made
    task = build_task("example-cnn", {"steps": 8, "optimizer": optimizer} |
                      ({"optimizer_args": {"momentum": 0.9}} if optimizer == "SGD" else {}))
    rec = Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x05" * 32, commit=Commitments(checkpoint_every=4),
                          online=Online(beacon=beacon.link(), spec=SPEC))
    rec.train(progress=False)
    manifest = json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[0])
    v = online(tmp_path / "b", beacon.public_key)
    if optimizer == "AdamW":
        assert manifest["format_version"] == 4 and manifest["online"]["chunks"] == SPEC.chunks
        assert v.accepted and v.moves["checked"] == 8
    else:
        assert "the bounded-move check is off for this run: SGD: its momentum sums the gradients" in \
            capsys.readouterr().err
        assert manifest["format_version"] == 2 and "chunks" not in manifest["online"]
        assert v.accepted and v.moves is None and "bounded move not checked" in " ".join(v.notes)


def test_a_kept_state_from_another_step_or_another_run_is_rejected(tmp_path, beacon):
    beacon.steer(hit={5, 13}, avoid={4, 12})  # replay starts at 5 (a replay passing through it checks it itself)
    train(tmp_path / "b", beacon.link())
    train(tmp_path / "other", beacon.link(), r=b"\x06" * 32)
    b = tmp_path / "b"
    shutil.copy(b / online_state_name(13), b / online_state_name(5))  # another step's state
    with pytest.raises(RunRejected, match="does not hash to the committed state"):
        online(b, beacon.public_key)
    shutil.copy(tmp_path / "other" / online_state_name(13) if (tmp_path / "other" / online_state_name(13)).exists()
                else tmp_path / "other" / "checkpoints" / "00000008.safetensors", b / online_state_name(5))
    with pytest.raises(RunRejected, match="does not hash to the committed state"):
        online(b, beacon.public_key)
    (b / online_state_name(5)).unlink()  # or none at all
    with pytest.raises(RunRejected, match="kept no state after 5"):
        online(b, beacon.public_key)


def test_kept_samples_that_are_not_the_committed_batch_are_rejected(tmp_path, beacon):
    beacon.steer(hit={6})
    train(tmp_path / "b", beacon.link())
    path = tmp_path / "b" / online_samples_name(6)
    doc = parse_canonical_json(path.read_bytes())
    doc["samples"][0] = bytes(len(bytes.fromhex(doc["samples"][0]))).hex()
    path.write_bytes(canonical_json(doc))
    with pytest.raises(RunRejected, match="sample .* is not the committed dataset's"):
        online(tmp_path / "b", beacon.public_key)


# --- statements: whose key, which run, all of them -------------------------------------------

def test_statements_signed_by_a_beacon_the_verifier_did_not_name_prove_nothing(tmp_path, beacon):
    (tmp_path / "own").mkdir()
    own = Beacon(tmp_path / "own")  # a beacon the trainer runs itself
    train(tmp_path / "b", own.link())
    with pytest.raises(VerificationError, match="not by the beacon key the verifier named"):
        online(tmp_path / "b", beacon.public_key)
    assert online(tmp_path / "b", own.public_key).accepted  # only under the key that signed them
    with pytest.raises(MalformedInput, match="--beacon-key"):
        Verifier(policy=Policy(mode="online")).verify(tmp_path / "b")


def test_a_statement_replayed_from_another_run_or_edited_is_rejected(tmp_path, beacon):
    train(tmp_path / "a", beacon.link())
    train(tmp_path / "b", beacon.link(), r=b"\x09" * 32)
    a, b = tmp_path / "a", tmp_path / "b"
    lines = (a / STATEMENTS).read_bytes().splitlines()
    other = (b / STATEMENTS).read_bytes().splitlines()
    (a / STATEMENTS).write_bytes(b"\n".join([*lines[:3], other[3], *lines[4:]]) + b"\n")
    with pytest.raises(VerificationError, match="answers another run"):
        online(a, beacon.public_key)
    st = json.loads(lines[3])
    st["beta"] = "00" * 32  # a trainer choosing its own draw
    (a / STATEMENTS).write_bytes(b"\n".join([*lines[:3], canonical_json(st), *lines[4:]]) + b"\n")
    with pytest.raises(VerificationError, match="signature on its statement"):
        online(a, beacon.public_key)


def test_a_withheld_statement_breaks_the_chain_and_missing_ones_are_not_audited_online(tmp_path, beacon):
    train(tmp_path / "b", beacon.link())
    b = tmp_path / "b"
    lines = (b / STATEMENTS).read_bytes().splitlines()
    # dropping a draw it disliked (and letting the next statement's beta judge those steps)
    (b / STATEMENTS).write_bytes(b"\n".join([*lines[:3], *lines[4:]]) + b"\n")
    with pytest.raises(VerificationError, match="a statement was withheld"):
        online(b, beacon.public_key)
    # the last windows without a statement: accepted, but those steps are not audited online and the
    # bound counts them as bad steps the audit cannot see
    (b / STATEMENTS).write_bytes(b"\n".join(lines[:4]) + b"\n")
    v = online(b, beacon.public_key)
    covered = statements(b)[-1].window(STEPS).stop
    assert v.online["unaudited"] == STEPS - covered and not v.online["final"]
    assert v.detection_probability == pytest.approx(online_bound(P, 0.05, STEPS, STEPS - covered))
    assert any("not audited online" in n for n in v.notes) and v.warning
    # nor is their move claimed checked: their windows' openings are passed over, and the line says so
    assert v.moves["checked"] == covered and v.moves["ignored"] and f"{STEPS - covered} step(s) in no window" in \
        v.moves["summary"] and f"{covered} of the run's {STEPS} step(s)" in v.moves["summary"]
    (b / STATEMENTS).unlink()
    v = online(b, beacon.public_key)
    assert v.online["windows"] == 0 and v.replayed_steps == 0 and v.detection_probability == 0.0


# --- the beacon itself -----------------------------------------------------------------------

def _head_log(key, records: int, salt: bytes = b"") -> RunLog:
    log = RunLog()
    log.append({"type": "manifest", "public_key": public_hex(key.public_key()), "n": 1})
    for i in range(1, records):
        log.append({"type": "step", "step": i - 1, "salt": salt.hex()})
    return log


def test_equivocation_is_refused_kept_as_proof_and_ends_the_run(beacon):
    key = generate_key()
    honest, fork = _head_log(key, 6), _head_log(key, 6, b"x")
    link = beacon.link()
    link.stamp(_prefix(honest, 1).sign_head(key), honest)
    assert link.stamp(_prefix(honest, 4).sign_head(key), honest).size == 4
    with pytest.raises(BeaconError, match="equivocation"):
        link.stamp(_prefix(fork, 4).sign_head(key), fork)
    run = beacon.http.get(f"/api/beacon/runs/{run_id(honest.lines[0]).hex()}").json()
    assert run["equivocated"]
    ev = run["evidence"][0]
    a, b = SignedTreeHead.from_json(ev["stamped"]), SignedTreeHead.from_json(ev["other"])
    a.verify(key.public_key())
    b.verify(key.public_key())  # both signed by the run's key: a fork anyone can check
    assert a.size == b.size == 4 and a.root != b.root
    with pytest.raises(BeaconError, match="equivocated"):
        link.stamp(honest.sign_head(key), honest)


def test_the_beacon_refuses_heads_that_do_not_extend_are_not_the_runs_or_go_back(beacon):
    key = generate_key()
    log = _head_log(key, 8)
    link = beacon.link()
    link.stamp(_prefix(log, 1).sign_head(key), log)
    link.stamp(_prefix(log, 5).sign_head(key), log)
    rewritten = _head_log(key, 8, b"r")  # a log rewritten after the stamped head: no consistency proof
    with pytest.raises(BeaconError, match="does not extend"):
        link.stamp(rewritten.sign_head(key), rewritten)
    with pytest.raises(BeaconError, match="signature"):
        link.stamp(log.sign_head(generate_key()), log)  # signed by another key than the manifest's
    with pytest.raises(BeaconError, match="older than the last"):
        link.stamp(_prefix(log, 3).sign_head(key), _prefix(log, 3))
    again = link.stamp(_prefix(log, 5).sign_head(key), log)  # the same head again: the same statement
    assert again == BeaconStatement.from_json(beacon.http.get(
        f"/api/beacon/runs/{run_id(log.lines[0]).hex()}").json()["statements"][1])
    resp = beacon.http.post("/api/beacon/heads", json={"tree_head": {"size": 1}})
    assert resp.status_code == 400
    assert beacon.http.get("/api/beacon/runs/" + "ab" * 32).status_code == 404


def _prefix(log: RunLog, n: int) -> RunLog:
    return RunLog(log.lines[:n])


def test_training_goes_on_while_the_beacon_is_down_and_waits_only_when_the_ring_is_full(tmp_path):
    import threading

    bkey = generate_key()
    db = f"sqlite:///{tmp_path / 'beacon.db'}"
    server, thread, url = start_uvicorn(create_app(db, bkey))
    port = int(url.rsplit(":", 1)[1])
    link = BeaconClient(url)  # the key fetched while the beacon is up
    stop_uvicorn(server, thread)  # then it goes down before the first head
    back = threading.Event()

    def restart() -> None:
        time.sleep(2.0)
        nonlocal server, thread
        server, thread, _ = start_uvicorn(create_app(db, bkey), port=port)  # the same beacon, on its address
        back.set()

    threading.Thread(target=restart, daemon=True).start()
    try:
        rec = train(tmp_path / "b", link, steps=STEPS)  # every request waits, retried, until the beacon is back
        r = rec.online.report()
        assert back.is_set()
        # it trained on while the ring had room, then waited for the beacon (counted, not fatal)
        assert r["waits"] >= 1 and r["wait_seconds"] > 0.5 and r["peak_ring"] == SPEC.ring
        v = online(tmp_path / "b", public_hex(bkey.public_key()))
        assert v.accepted and v.online["final"] and v.online["unaudited"] == 0
    finally:
        back.wait(30)
        stop_uvicorn(server, thread)


# --- killed and resumed ----------------------------------------------------------------------

@pytest.mark.parametrize("threads,lose", [(1, False), (2, True)])
def test_an_honest_run_killed_and_resumed_verifies_online(tmp_path, threads, lose):
    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    bkey = generate_key()
    server, thread, url = start_uvicorn(create_app(f"sqlite:///{tmp_path / 'beacon.db'}", bkey))
    try:
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", "100", "--checkpoint-every",
               "25", "--seed", "online", "--key", str(key), "--out", str(out), "--quiet", "--threads", str(threads),
               "--beacon", url, "--online-p", "0.2", "--online-every", "4"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline:
            st = out / STATEMENTS
            if st.exists() and st.read_bytes().count(b"\n") >= 8 and any((out / "online" / "states").glob("*")):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kept = sorted((out / "online" / "states").glob("*.safetensors"))
        if lose:  # a selected state the crash lost: rebuilt from the checkpoint before it; and every
            kept[0].unlink()  # window's chunk openings, opened again as the resumed run passes their states
            for f in (out / "online" / "chunks").glob("*"):
                f.unlink()
        res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        # (a statement the beacon signed as the process died, fetched again, can ask for ring states too)
        assert not lose or "lost state(s) rebuilt from a checkpoint" in res.stderr
        v = online(out, public_hex(bkey.public_key()))
        assert v.accepted and v.complete and v.online["final"] and v.online["unaudited"] == 0
        assert v.threads == threads and v.moves["checked"] == 100
    finally:
        stop_uvicorn(server, thread)


def test_beacon_serve_prints_and_serves_its_key(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "beacon", "serve", "--port", "0", "--db",
                             f"sqlite:///{tmp_path / 'b.db'}", "--key", str(tmp_path / "bk.pem")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("beacon public key ")
        pub = line.split()[3]
        assert (tmp_path / "bk.pem").exists() and len(pub) == 64
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_leaderboard_answers_each_streamed_head_with_its_beacons_statement(tmp_path):
    from lbhelpers import Authed, make_settings, register

    from witness.leaderboard import client as C
    from witness.leaderboard.app import create_app as leaderboard_app

    client = TestClient(leaderboard_app(make_settings("sqlite", tmp_path)))
    trainer = register(client, "alice")
    run_id, _ = C.train_ticketed(Authed(client, trainer.token), "quick", trainer.key, tmp_path / "run",
                                 C.TicketedRun(checkpoint_every=5, online=True))
    bundle = tmp_path / "run"
    server_key = client.get("/api/server-key").json()["public_key"]
    assert client.get("/api/beacon/key").json()["public_key"] == server_key  # one key for both
    heads = client.get(f"/api/runs/{run_id}/heads").json()
    run = client.get(f"/api/beacon/runs/{run_id_of(bundle)}").json()
    sts = [BeaconStatement.from_json(x) for x in run["statements"]]
    assert [s.size for s in sts] == [h["size"] for h in heads] and run["final"]
    for st in sts:
        st.verify(public_key_from_hex(server_key))
    assert [s.prev_size for s in sts] == [0] + [s.size for s in sts[:-1]]
    # the run streamed each head once, and the statements it kept are the server's
    assert statements(bundle) == sts
    v = online(bundle, server_key)
    assert v.accepted and v.online["final"] and v.online["unaudited"] == 0


def run_id_of(bundle: Path) -> str:
    return run_id((bundle / "log.jsonl").read_bytes().split(b"\n")[0]).hex()


def test_the_online_benchmark_runs_end_to_end(tmp_path):
    # its smoke test: a short run, every phase, the figures it reports
    bench = Path(__file__).parent.parent / "bench" / "online_cost.py"
    r = subprocess.run([sys.executable, str(bench), "--steps", "30", "--checkpoint-every", "10", "--every", "5",
                        "--repeat", "1", "--json", str(tmp_path / "out.json")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["steps"] == 30 and out["statements"] >= 7 and out["verify_online_replayed_steps"] == out["selected_steps"]
    assert out["respond_s"] > 0 and out["peak_ring_states"] <= out["ring"] and out["detection_probability"] >= 0.99
    chunks = out["chunks"]  # what checking every step adds: trees hashed, openings written and checked
    assert chunks["trees"] == 31 and chunks["openings_bytes"] > 0 and chunks["extra_bytes"] > chunks["openings_bytes"]
    assert out["beacon"]["verify"]["moves_checked_steps"] == 30 and chunks["verifier_extra_s"] > 0


def test_a_beacon_that_is_not_the_pinned_one_stops_training_before_it_starts(tmp_path, capsys):
    from helpers import with_beacon

    from witness.cli import main

    pinned = public_hex(generate_key().public_key())
    codes = []
    with_beacon(tmp_path, lambda url: codes.append(main(
        ["train", "--task", "tiny", "--steps", "4", "--out", str(tmp_path / "run"), "--key", str(tmp_path / "k.pem"),
         "--quiet", "--beacon", url, "--beacon-key", pinned])))
    assert codes == [2] and "not the pinned" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("garbage", [b"not json\n", b'{"type": "statement"}\n', b"\xff\xfe\n"])
def test_garbage_statements_are_refused_offline_and_by_respond_too(tmp_path, beacon, capsys, garbage):
    out = tmp_path / "run"
    train(out, beacon.link())
    kept = (out / STATEMENTS).read_bytes()
    (out / STATEMENTS).write_bytes(kept + garbage)
    assert main(["verify", "--allow-weak", str(out), "--challenges", "2"]) == 2
    assert "is not a beacon statement" in capsys.readouterr().err
    assert main(["respond", str(out), "--nonce", "5eed", "--challenges", "2", "--out", str(tmp_path / "a")]) == 2
    assert "is not a beacon statement" in capsys.readouterr().err
    # a last line torn by a crash is no garbage: offline verification reads what is whole
    (out / STATEMENTS).write_bytes(kept + kept.splitlines(keepends=True)[0][:30])
    assert main(["verify", "--allow-weak", str(out), "--challenges", "2"]) == 0, capsys.readouterr().err


# --- the ring, sized by memory ------------------------------------------------------------------

def test_a_kept_state_is_as_large_as_estimated_before_the_first_step():
    # the ring is sized before step 0, when the optimizer holds no moments yet
    from witness.bundle.state import state_tensors
    from witness.record.start import kept_bytes
    from witness.session import TrainingSession

    for name in ("tiny", "tinycnn", "tinygpt"):
        task = build_task(name, {"steps": 2})
        s = TrainingSession(task, b"\x01" * 32, len(task.dataset()))
        before = kept_bytes(s.model, s.optimizer)
        batch = task.collate([task.dataset().sample_bytes(i) for i in range(2)])
        task.train_step(s.model, s.optimizer, batch, 0.01, 1)
        after = sum(t.numel() * t.element_size() for t in state_tensors(s.model, s.optimizer).values())
        assert s.optimizer.state and abs(before - after) <= 8 * len(s.optimizer.state), (name, before, after)


def test_the_ring_holds_what_its_budget_fits_and_the_run_verifies(tmp_path, beacon):
    from witness.record.start import kept_bytes
    from witness.session import TrainingSession

    task = build_task("tiny", {"steps": STEPS})
    s = TrainingSession(task, b"\x01" * 32, len(task.dataset()))
    size = kept_bytes(s.model, s.optimizer)
    rec = Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x05" * 32, commit=Commitments(checkpoint_every=8),
                          online=Online(beacon=beacon.link(), spec=SPEC, ring_bytes=(EVERY + 2) * size + size // 2))
    assert rec.online.spec.ring == EVERY + 2 < SPEC.ring  # cut to the budget, and so in the manifest
    rec.train(progress=False)
    assert rec.online.report()["peak_ring"] <= EVERY + 2
    v = online(tmp_path / "b", beacon.public_key)
    assert v.accepted and v.replayed_steps == rec.online.report()["selected"]


def test_a_ring_budget_that_cannot_hold_a_window_is_refused_before_anything_is_written(tmp_path, beacon):
    from witness.record.start import kept_bytes
    from witness.session import TrainingSession

    task = build_task("tiny", {"steps": STEPS})
    s = TrainingSession(task, b"\x01" * 32, len(task.dataset()))
    size = kept_bytes(s.model, s.optimizer)
    with pytest.raises(ValueError, match=r"cannot hold one window.*shorter window.*more ranks.*larger budget.*offline"):
        Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x05" * 32,
                        online=Online(beacon=beacon.link(), spec=SPEC, ring_bytes=EVERY * size))
    assert not (tmp_path / "b").exists()
    # one state more (a window's first to its last) is enough
    rec = Recorder.create(task, tmp_path / "c", generate_key(), r=b"\x05" * 32,
                          online=Online(beacon=beacon.link(), spec=SPEC, ring_bytes=(EVERY + 1) * size))
    assert rec.online.spec.ring == EVERY + 1
    rec.train(progress=False)
    assert online(tmp_path / "c", beacon.public_key).accepted


def test_the_ring_budget_flag_reads_amounts_of_memory_and_goes_with_a_beacon(tmp_path, capsys):
    import argparse

    from witness.cli import main
    from witness.cli.args import memory

    assert memory("8GiB") == 8 << 30 and memory("512 MiB") == 512 << 20 and memory("1.5GB") == 1_500_000_000
    assert memory("4096") == 4096
    for bad in ("8XB", "-1GiB", "0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory(bad)
    args = ["train", "--task", "tiny", "--steps", "2", "--key", str(tmp_path / "k.pem"), "--quiet"]
    assert main([*args, "--out", str(tmp_path / "a"), "--online-ring-memory", "1GiB"]) == 2
    assert "--online-ring-memory go with --beacon" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("change", [{"chunks": 257}, {"every": 1100, "ring": 1101, "chunks": 256}])
def test_settings_a_verifier_would_refuse_to_read_are_refused_before_step_0(tmp_path, beacon, change):
    """More chunks a state, or a window of more opened bytes, than a manifest may hold: the recorder refuses
    them at once, rather than record a run every verifier then refuses to read."""
    task = build_task("tiny", {"steps": STEPS})
    with pytest.raises(ValueError, match="no verifier reads"):
        Recorder.create(task, tmp_path / "b", generate_key(), r=b"\x05" * 32,
                        online=Online(beacon=beacon.link(), spec=dataclasses.replace(SPEC, **change)))
    assert not (tmp_path / "b").exists()
