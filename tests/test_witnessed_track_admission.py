"""What a leaderboard's operator log takes (``WitnessedRuns.admit_operator``): only heads a run streamed
to the leaderboard first, and only runs whose seed is their own ticket's (attacks found by review)."""

from __future__ import annotations

from lbhelpers import Authed, register
from test_witnessed_track import outside, server  # noqa: F401 - the fixtures (a leaderboard with its witnesses)

from witness.commit.beacon import run_id
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.log import RunLog
from witness.commit.note import Checkpoint, Note, run_origin, sign_note
from witness.commit.operator import seed_tag
from witness.data.order import derive_run_seed
from witness.leaderboard import client as C


def _streamed(tc, trainer, out):
    """A ticket on the witnessed track whose manifest is streamed as ``witness train`` streams it (the
    recorder signs and streams the manifest's head at creation). Returns (authed client, ticket, manifest)."""
    from witness.record import Commitments, Online, Recorder
    from witness.record.online import OnlineSpec
    from witness.task import build_task

    a = Authed(tc, trainer.token)
    tk = C.ticket(a, "wit")
    task = build_task(tk["task"], tk["config"])
    spec = OnlineSpec.for_steps(task.config.steps, every=4, drand=tk["witnessed"]["drand"]["chain"]["hash"])
    Recorder.create(task, out, trainer.key, r=bytes.fromhex(tk["r"]), commit=Commitments(r_source="ticket"),
                    online=Online(beacon=C.LeaderboardWitnessed(a, tk["run_id"], tk["witnessed"]), spec=spec,
                                  on_head=C.HeadStreamer(a, tk["run_id"], records=True)))
    manifest = (out / "log.jsonl").read_bytes().split(b"\n")[0]
    return a, tk, manifest


def _stream_manifest(a, key, run_id_, line: bytes):
    """Stream a manifest line as a run's first head (what any account may send for its own ticket)."""
    head = RunLog([line]).sign_head(key)
    return a.post(f"/api/runs/{run_id_}/heads", json={"tree_head": head.to_json(), "manifest": line.decode()})


def test_operator_heads_the_leaderboard_never_received_are_refused(server, tmp_path):  # noqa: F811
    """Heads of its own run that an account never streamed to the leaderboard (a junk log of any size: the
    log itself checks only the run key's signature and consistency) would grow the log every worker reads
    to price each witnessed run (past MAX_ENTRIES, every run's attempts unknown and its bound 0), and make
    the server ask every witness to cosign each: the log takes only a head streamed here first."""
    lb, tc = server
    mallory = register(tc, "mallory")
    a, tk, manifest = _streamed(tc, mallory, tmp_path / "run")
    run = run_id(manifest)
    assert a.post("/api/operator/runs", json={"manifest": manifest.decode()}).status_code == 200
    before = lb.operator_log().size()
    log, origin, old, codes = RunLog([manifest]), run_origin(run), 0, []
    for k in range(8):  # a junk log, never streamed to POST /api/runs/ID/heads
        log.append_line(canonical_json({"junk": k}))
        text = Checkpoint(origin, len(log), log.root()).text()
        note = Note(text, (sign_note(text, origin, mallory.key),)).encode().decode()
        proof = [h.hex() for h in log.tree.consistency_proof(old, len(log))] if old else []
        resp = a.post("/api/operator/heads", json={"run": run.hex(), "checkpoint": note, "old": old, "proof": proof})
        codes.append(resp.status_code)
        old = len(log)
    streamed = [h["size"] for h in tc.get(f"/api/runs/{tk['run_id']}/heads").json()]
    assert streamed == [1]
    assert lb.operator_log().size() == before and all(c in (403, 409) for c in codes), \
        f"{lb.operator_log().size() - before} operator entries from heads the leaderboard never received: {codes}"


def test_a_manifest_whose_run_seed_is_not_its_tickets_is_refused(server, tmp_path):  # noqa: F811
    """Whoever learns a run's seed (its trainer's logs, a leak) could stream a manifest of that seed under a
    ticket of their own, be admitted to the operator log, and register a run that every verifier prices
    against the victim's: a manifest's run seed must be H(data root || r) of its own ticket."""
    lb, tc = server
    alice, bob = register(tc, "alice"), register(tc, "bob")
    _, _, victim = _streamed(tc, alice, tmp_path / "alice")
    seed = parse_canonical_json(victim)["run_seed"]
    b = Authed(tc, bob.token)
    t = C.ticket(b, "wit")
    assert derive_run_seed(bytes.fromhex(t["data_root"]), bytes.fromhex(t["r"])).hex() != seed
    forged = canonical_json(parse_canonical_json(victim) | {"r": t["r"], "public_key": _key_hex(bob.key),
                                                           "run_seed": seed})
    resp = _stream_manifest(b, bob.key, t["run_id"], forged)
    reg = b.post("/api/operator/runs", json={"manifest": forged.decode()})  # then admitted to the operator log
    entry = parse_canonical_json(lb.operator_log().entries(reg.json()["index"], 1)[0].encode()) \
        if reg.status_code == 200 else None
    priced = entry is not None and entry["seed_tag"] == seed_tag(bytes.fromhex(seed), run_id(forged)).hex()
    assert resp.status_code == 400 and "seed" in resp.text, \
        f"streamed: {resp.status_code}; registered: {reg.status_code}; under the victim's seed tag: {priced}"


def _key_hex(key) -> str:
    from witness.commit.signing import public_hex
    return public_hex(key.public_key())
