"""Leaderboard tracks that require online challenges: the server's workers replay the selected
steps while the run trains, a failed one rejects the run at once, and the submission carries no
intermediate checkpoints."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

import pytest
import torch
from fastapi.testclient import TestClient
from lbhelpers import Authed, make_settings, register
from sqlalchemy import select

from witness.leaderboard import client as C
from witness.leaderboard.app import create_app
from witness.leaderboard.db import OnlineStep, OnlineWindow, Run
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work

ONLINE = "live=tiny:steps=100,online=0.5@accuracy+"  # the trainer's default p at 100 steps: 0.60
EVERY_STEP = "all=tiny:steps=20,online=1.0@accuracy+"  # p = 1: every step is selected (deterministic tests)


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path):
    """A leaderboard with two online tracks and the after-the-fact quick track."""
    settings = make_settings(request.param, tmp_path, tracks=(parse_track(ONLINE), parse_track(EVERY_STEP),
                                                               parse_track("quick=tiny:steps=20@accuracy+")))
    lb = Leaderboard(settings)
    with TestClient(create_app(lb=lb)) as tc:
        yield lb, tc
    lb.engine.dispose()


def _train(tc, trainer, track, out, lr_factor=None, checkpoint_every=5):
    return C.train_ticketed(Authed(tc, trainer.token), track, trainer.key, out,
                            C.TicketedRun(checkpoint_every=checkpoint_every, online=True, lr_factor=lr_factor))[0]


def _steps(lb, run_id) -> dict[int, str]:
    with lb.Session() as s:
        return {r.step: r.status for r in s.scalars(select(OnlineStep).where(OnlineStep.run_id == run_id))}


def test_selected_steps_are_replayed_before_submission_and_not_again(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    run_id = _train(tc, alice, "live", tmp_path / "run", checkpoint_every=2)
    steps = _steps(lb, run_id)
    assert steps and set(steps.values()) == {"ready"}  # every selected state and batch arrived while training
    # the statements select what the bundle kept, with the track's p
    bundle = tmp_path / "run"
    kept = sorted(int(p.name[:8]) for p in (bundle / "online" / "samples").iterdir())
    assert kept == sorted(steps)
    assert json.loads((bundle / "log.jsonl").read_text().split("\n")[0])["online"]["p"] >= 0.5
    # the workers replay them while the run is still open (here: before it is submitted)
    assert work(lb, once=True) >= 1
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "ticketed" and r["online"]["verified"] == len(steps) and r["online"]["failed"] == 0
    # every window's chunk openings came too, and the live round checked every step of every window (the
    # last window that holds steps closes at the last checkpoint's head, short of the final one)
    with lb.Session() as s:
        windows = {w.size: w.status for w in s.scalars(select(OnlineWindow).where(OnlineWindow.run_id == run_id))}
    assert len(windows) == len(list((bundle / "online" / "chunks").iterdir())) == 50
    assert set(windows.values()) == {"checked"} and r["online"]["moves_checked"] == 100 and r["online"]["chunks"] == 2
    assert "every step: bounded move checked at 2 chunk(s) per step</strong> while it trains" in \
        tc.get(f"/runs/{run_id}").text
    # each window's openings are taken once, and only for a window the server's beacon opened
    path = bundle / "online" / "chunks" / f"{max(windows):08d}.safetensors"
    with lb.Session() as s:  # at most what a window's states, chunks and paths can take (not the manifest's ring)
        assert lb.openings_limit(s, run_id, range(4, 6)) == 3 * 2 * (1024 + 41 * 32) + (1 << 16)
    for size, code in ((max(windows), 409), (2, 404), (1, 409)):  # (the manifest's head opens no step)
        resp = tc.put(f"/api/runs/{run_id}/online/chunks/{size}", content=path.read_bytes(),
                      headers={"Authorization": f"Bearer {alice.token}", "Content-Type": "application/octet-stream"})
        assert resp.status_code == code, resp.text
    # a run that streamed no head yet (so no manifest) takes no openings
    fresh = C.ticket(Authed(tc, alice.token), "live")["run_id"]
    resp = tc.put(f"/api/runs/{fresh}/online/chunks/6", content=path.read_bytes(),
                  headers={"Authorization": f"Bearer {alice.token}", "Content-Type": "application/octet-stream"})
    assert resp.status_code == 409 and "takes no online challenges" in resp.text, resp.text
    page = tc.get("/tracks/live").text
    assert f"{len(steps)} of {len(steps)} selected step(s) verified" in page and "required, with p ≥ 0.5" in page
    hist = tc.get(f"/api/runs/{run_id}/challenges").json()
    assert {h["kind"] for h in hist} == {"online"} and all(h["passed"] for h in hist)
    assert sorted(c["step"] for h in hist for c in h["challenges"]) == sorted(steps)
    # the submission leaves out the intermediate checkpoints that the online audit does not need
    cert = C.write_evaluation(bundle, alice.key, tmp_path / "eval.json")
    leave_out = C.online_leave_out(bundle)
    # kept: the initial and final checkpoints, and those that end a selected step (tolerance mode)
    assert leave_out == {f"checkpoints/{k:08d}.safetensors" for k in range(2, 100, 2) if k - 1 not in steps}
    assert leave_out  # (all 49 kept only if all of steps 1, 3, .., 97 were selected: p = 0.6^49)
    out = C.submit(Authed(tc, alice.token), bundle, cert)
    assert work(lb, once=True) == 1
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified", r["reason"]
    v = r["verdict"]
    assert v["mode"] == "online" and v["challenges"] == len(steps) and v["replayed_steps"] == 0
    assert any("replayed by an earlier audit of the same commitments" in c for c in v["checks"])
    # counted from their evidence: every selected step is in the ledger, from the live rounds
    assert sorted(e["step"] for e in v["ledger"]) == sorted(steps) and all(e["earlier"] for e in v["ledger"])
    assert r["bound"] == v["detection_probability"] >= 0.99
    assert v["moves"]["checked"] == 100 and "every step: bounded move checked at 2 chunk(s)" in \
        tc.get(f"/runs/{run_id}").text
    tar = tarfile.open(fileobj=io.BytesIO(tc.get(f"/runs/{out['run_id']}/download/submission.tar").content))
    names = set(tar.getnames())
    assert not {f"bundle/{n}" for n in leave_out} & names and "bundle/checkpoints/00000100.safetensors" in names
    # a re-challenge after the fact still works: it replays from the states the submission holds
    job = C.challenge(Authed(tc, alice.token), run_id, 5)
    assert work(lb, once=True) == 1
    rnd = C.wait_round(Authed(tc, alice.token), run_id, job["job_id"], timeout=5)
    assert rnd["passed"], rnd["detail"]
    assert tc.get(f"/api/runs/{run_id}").json()["bound"] >= r["bound"]


def _online_recorder(tc, trainer, track, out, link=C.LeaderboardBeacon, p=1.0):
    """A recorder on a ticket of ``track`` that takes online challenges from the leaderboard."""
    from witness.record import Commitments, Online, Recorder, SelfChecking
    from witness.record.online import OnlineSpec
    from witness.task import build_task

    a = Authed(tc, trainer.token)
    tk = C.ticket(a, track)
    task = build_task(tk["task"], tk["config"])
    return Recorder.create(task, out, trainer.key, r=bytes.fromhex(tk["r"]),
                           commit=Commitments(checkpoint_every=5, r_source="ticket"),
                           online=Online(beacon=link(a, tk["run_id"]),
                                         spec=OnlineSpec.for_steps(task.config.steps, p=p)),
                           self_check=SelfChecking(enabled=False))  # some of these trainers cheat


def _steps_of(rec, steps, factor=lambda t: 1.0):
    for t in steps:
        out = rec.task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t) * factor(t), rec.step_seed(t))
        rec.log_step(t, dataclasses.replace(out, lr=rec.lr(t)))


def test_a_bad_step_rejects_the_run_while_it_trains(server, tmp_path):
    lb, tc = server
    mallory = register(tc, "mallory")
    # every step is selected (p = 1); steps 6.. are trained with a secretly larger learning rate
    rec = _online_recorder(tc, mallory, "all", tmp_path / "run")
    _steps_of(rec, range(12), lambda t: 3.0 if t >= 6 else 1.0)
    rec.online.wait()  # the heads up to step 10's checkpoint are answered, their states uploaded
    assert work(lb, once=True) == 1  # the server's worker replays them while the run is still training
    with pytest.raises(C.BeaconError, match="rejected: online challenge failed while the run trained"):
        with rec.stopped_on_failure():
            _steps_of(rec, range(12, 20))
            rec.finish()
    # the recorder's beacon thread was stopped with the loop: what it had queued is not sent
    assert rec.online._worker._shutdown
    rec.online._worker.shutdown(wait=True)  # (a request in flight is answered by the server)
    # (this recorder's thread: another test's recorder, left unfinished, may still hold an idle one)
    assert not any(t.is_alive() for t in rec.online._worker._threads)
    with lb.Session() as s:
        run = s.scalars(select(Run)).one()
    assert run.status == "rejected" and "step 6" in run.reason
    assert run.submitted_ms is not None and run.statement  # decided, in public, and signed by the server
    steps = _steps(lb, run.id)
    assert steps[5] == "passed" and steps[6] == "failed"
    page = tc.get(f"/runs/{run.id}").text
    assert "online challenge failed while the run trained" in page and "failed" in page
    # the server's signed decision names the uploaded state it failed from
    env = tc.get(f"/api/runs/{run.id}/certification").json()
    from witness.leaderboard.certification import check_certification

    cert = check_certification(env, lb.public_key)
    assert cert.decision == "rejected" and cert.subjects[0]["name"].endswith("state-00000006.safetensors")


def test_a_weight_moved_too_far_rejects_the_run_while_it_trains_where_no_draw_selects_its_step(server, tmp_path):
    """The draws miss step 9 (a steered beacon); the trainer nudges every weight before training it.
    Replay never sees it; the window's chunk openings show a coordinate moving past AdamW's bound."""
    import os

    from witness.commit.beacon import selected

    lb, tc = server

    def draw(prev_size: int, size: int) -> bytes:
        while True:
            beta = os.urandom(32)
            if not any(selected(beta, t, 0.5) for t in (8, 9)):
                return beta

    lb.beacon.draw = draw
    mallory = register(tc, "mallory")
    rec = _online_recorder(tc, mallory, "live", tmp_path / "run", p=0.5)

    def nudge(t: int) -> float:
        if t == 9:
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(0.01)
        return 1.0

    _steps_of(rec, range(12), nudge)
    rec.online.wait()
    assert work(lb, once=True) == 1
    with lb.Session() as s:
        run = s.scalars(select(Run)).one()
        windows = {w.size: w.status for w in s.scalars(select(OnlineWindow).where(OnlineWindow.run_id == run.id))}
    assert run.status == "rejected" and "the chunk openings of a window" in run.reason, run.reason
    assert "step 9: moves: model." in run.reason and "failed" in windows.values()
    assert 9 not in _steps(lb, run.id)
    from witness.leaderboard.certification import check_certification

    cert = check_certification(tc.get(f"/api/runs/{run.id}/certification").json(), lb.public_key)
    assert cert.decision == "rejected" and "-chunks-" in cert.subjects[0]["name"]
    # the recorder stops here, its requests answered before the server goes (a request in flight when the
    # test client closes would hold its teardown; the trainer hearing the rejection is the test above's)
    rec.online.close()
    rec.online._worker.shutdown(wait=True)


def test_a_track_requires_online_challenges_with_its_least_p(server, tmp_path):
    lb, tc = server
    bob = register(tc, "bob")
    # without online challenges: the first head is refused
    with pytest.raises(C.LeaderboardError, match="requires online challenges with p >= 0.5"):
        C.train_ticketed(Authed(tc, bob.token), "live", bob.key, tmp_path / "a", C.TicketedRun(checkpoint_every=5))
    # with a lower p than the track's
    from witness.record import Commitments, Online, Recorder
    from witness.record.online import OnlineSpec
    from witness.task import build_task

    tk = C.ticket(Authed(tc, bob.token), "live")
    link = C.LeaderboardBeacon(Authed(tc, bob.token), tk["run_id"])
    rec = Recorder.create(build_task("tiny", tk["config"]), tmp_path / "b", bob.key, r=bytes.fromhex(tk["r"]),
                          commit=Commitments(checkpoint_every=5, r_source="ticket"),
                          online=Online(beacon=link, spec=OnlineSpec.for_steps(100, p=0.1)))
    with pytest.raises(C.BeaconError, match="p >= 0.5"):
        rec.online.wait()  # the first head's answer: the training stops at the next step
    rec.online.close()


def test_uploads_are_taken_only_for_selected_steps_once_and_by_the_owner(server, tmp_path):
    lb, tc = server
    alice, eve = register(tc, "alice"), register(tc, "eve")
    rec = _online_recorder(tc, alice, "live", tmp_path / "run", p=0.6)
    _steps_of(rec, range(20))
    rec.online.wait()
    run_id = rec.online.link.run_id
    steps = _steps(lb, run_id)
    chosen = min(steps)
    other = min(set(range(20)) - set(steps))
    state = (tmp_path / "run" / "online" / "states" / f"{chosen:08d}.safetensors").read_bytes()
    a, e = Authed(tc, alice.token), Authed(tc, eve.token)
    url = f"/api/runs/{run_id}/online/states"
    assert tc.put(f"{url}/{chosen}", content=state, headers=e.headers).status_code == 403
    again = tc.put(f"{url}/{chosen}", content=state, headers=a.headers)
    assert again.status_code == 409 and "came already" in again.json()["detail"]  # taken once
    refused = tc.put(f"{url}/{other}", content=state, headers=a.headers)
    assert refused.status_code == 404 and "selected no step" in refused.json()["detail"]
    assert tc.put(f"/api/runs/{run_id}/online/other/{chosen}", content=b"x", headers=a.headers).status_code == 400
    assert tc.put(f"{url}/{chosen}", content=state).status_code == 401
    lb.settings.max_upload = 1000  # a state over the server's limit is refused before it is read whole
    big = tc.put(f"{url}/{other}", content=b"\0" * 1001, headers=a.headers)
    assert big.status_code == 404  # (and an upload for no selected step before any byte of it is stored)
    assert not list((lb.store.root / "incoming").glob("upload-*"))  # nothing of it is left behind
    # a run of an after-the-fact track takes no online uploads
    tk = C.ticket(a, "quick")
    assert tc.put(f"/api/runs/{tk['run_id']}/online/states/0", content=b"x", headers=a.headers).status_code == 409
    rec.online.close()


def test_a_state_from_another_step_is_a_failed_step(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    swapped = {}

    class Swapping(C.LeaderboardBeacon):
        """Uploads, for each selected step after the first, the state it uploaded for the one before."""

        def publish(self, kind, step, path):
            if kind == "states":
                if swapped.get("last") is not None:
                    swapped[step] = swapped["last"]
                    path = path.with_name(f"{swapped['last']:08d}.safetensors")
                swapped["last"] = step
            super().publish(kind, step, path)

    rec = _online_recorder(tc, alice, "live", tmp_path / "run", link=Swapping, p=0.6)
    _steps_of(rec, range(30))
    rec.online.wait()
    assert work(lb, once=True) == 1
    run_id = rec.online.link.run_id
    steps = _steps(lb, run_id)
    # a selected step whose step before was not selected is replayed from the state uploaded for it
    # (after a selected step, replay goes on from the state it checked bit for bit)
    alone = [t for t in swapped if t != "last" and t - 1 not in steps]
    assert alone and all(steps[t] == "failed" for t in alone)
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "rejected" and "does not hash to the committed state" in r["reason"]
    rec.online.close()


def test_an_online_submission_without_its_initial_checkpoint_is_rejected(server, tmp_path, monkeypatch):
    lb, tc = server
    mallory = register(tc, "mallory")
    run_id = _train(tc, mallory, "all", tmp_path / "run")
    cert = C.write_evaluation(tmp_path / "run", mallory.key, tmp_path / "eval.json")
    # a submission that leaves its re-challenges nothing to replay from before its first kept state
    leave = C.online_leave_out
    monkeypatch.setattr(C, "online_leave_out", lambda b: leave(b) | {"checkpoints/00000000.safetensors"})
    C.submit(Authed(tc, mallory.token), tmp_path / "run", cert)
    while work(lb, once=True):  # the live rounds, then the certification
        pass
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "rejected" and "leaves out its initial checkpoint" in r["reason"]


def test_an_accounts_abandoned_attempts_are_priced_into_its_certified_bound(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    # an attempt walked away from after its first windows were drawn
    rec = _online_recorder(tc, alice, "live", tmp_path / "gone", p=0.6)
    _steps_of(rec, range(12))
    rec.online.wait()
    rec.online.close()
    assert tc.get(f"/api/runs/{rec.online.link.run_id}").json()["status"] == "ticketed"
    run_id = _train(tc, alice, "live", tmp_path / "run")
    cert = C.write_evaluation(tmp_path / "run", alice.key, tmp_path / "eval.json")
    C.submit(Authed(tc, alice.token), tmp_path / "run", cert)
    while work(lb, once=True):
        pass
    r = tc.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified", r["reason"]
    v = r["verdict"]
    assert v["online"]["attempts"] == 1 and "over 2 attempt(s)" in v["online"]["linking"]
    from witness.commit.beacon import online_bound

    assert r["bound"] == pytest.approx(online_bound(v["online"]["p"], lb.settings.bad_fraction, 100, 0, 1))


def test_openings_that_are_not_a_safetensors_file_are_what_the_rejection_names(server, tmp_path, monkeypatch):
    """A window's openings uploaded as something else: the run is rejected while it trains, and the reason
    and the signed decision name that window's openings file, not the run's log (issue 52, item 9)."""
    lb, tc = server
    keep = C.publish_kept

    def garbled(bounded, run_id, kind, step, path):  # noqa: ANN001, ANN202
        if kind == "chunks":
            path = path.with_name(path.name + ".garbled")
            path.write_bytes(b"these are not a window's openings")
        return keep(bounded, run_id, kind, step, path)

    monkeypatch.setattr(C, "publish_kept", garbled)
    mallory = register(tc, "mallory")
    rec = _online_recorder(tc, mallory, "live", tmp_path / "run", p=0.5)
    _steps_of(rec, range(12))
    rec.online.wait()
    assert work(lb, once=True) == 1
    with lb.Session() as s:
        run = s.scalars(select(Run)).one()
    assert run.status == "rejected" and "are not a safetensors file" in run.reason, run.reason
    assert "(the chunk openings of a window)" in run.reason
    from witness.leaderboard.certification import check_certification

    cert = check_certification(tc.get(f"/api/runs/{run.id}/certification").json(), lb.public_key)
    assert cert.decision == "rejected" and "-chunks-" in cert.subjects[0]["name"], cert.subjects
    rec.online.close()
    rec.online._worker.shutdown(wait=True)
