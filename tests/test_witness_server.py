"""`witness beacon serve` as a C2SP tlog-witness, on SQLite and PostgreSQL: registration, every status of
add-checkpoint, the race the spec forbids, a repeat's first cosignature, fork evidence, monitoring, the
attempts note, and the client; once against a real server process."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import httpx
import pytest
from lbhelpers import fresh_postgres
from starlette.testclient import TestClient

from witness.beacon.app import create_app
from witness.beacon.db import create_tables
from witness.beacon.witness import MAX_BODY, Witness, WitnessConflict
from witness.beacon.witness_client import WitnessClient, WitnessError
from witness.beacon.witness_db import WitnessFork, WitnessLog
from witness.commit.attempts import AttemptsNote
from witness.commit.beacon import run_id
from witness.commit.cosignature import verify_cosignature
from witness.commit.log import RunLog
from witness.commit.merkle import EMPTY_ROOT
from witness.commit.note import (
    COSIGNATURE_V1,
    ED25519,
    Checkpoint,
    Note,
    NoteKey,
    NoteSignature,
    origin_hash,
    parse_note,
    run_origin,
    sign_note,
    verify_note_signature,
)
from witness.commit.signing import SignedTreeHead, generate_key, public_hex
from witness.database import make_engine, sessions

P = "/api/beacon"
NAME = "witness.example/w1"


def _db(backend: str, tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'w.db'}" if backend == "sqlite" else fresh_postgres()


@pytest.fixture(params=["sqlite", "postgresql"])
def http(request, tmp_path):
    with TestClient(create_app(_db(request.param, tmp_path), generate_key(), name=NAME),
                    raise_server_exceptions=False) as client:
        yield client


class Run:
    """A run's log, its key, and its checkpoints as signed notes."""

    def __init__(self, key=None, records: int = 40, seed: str | None = "11" * 32, **manifest):  # noqa: ANN001
        self.key = key or generate_key()
        self.log = RunLog()
        fields = {"run_seed": seed} if seed is not None else {}
        self.log.append({"type": "manifest", "public_key": public_hex(self.key.public_key()), **fields, **manifest})
        for i in range(1, records):
            self.log.append({"type": "step", "step": i - 1})
        self.manifest = self.log.lines[0]
        self.origin = run_origin(run_id(self.manifest))
        self.vkey = NoteKey.of(self.origin, self.key.public_key())

    def note(self, size: int, root: bytes | None = None, signer=None, extensions=()) -> bytes:  # noqa: ANN001
        text = Checkpoint(self.origin, size, self.log.root(size) if root is None else root, tuple(extensions)).text()
        return Note(text, (sign_note(text, self.origin, signer or self.key),)).encode()

    def proof(self, old: int, size: int) -> list[bytes]:
        return self.log.tree.consistency_proof(old, size) if 0 < old < size else []


def body(old: int, proof: list[bytes], note: bytes) -> bytes:
    return f"old {old}\n".encode() + b"".join(base64.b64encode(h) + b"\n" for h in proof) + b"\n" + note


def add(http, run: Run, old: int, size: int, **kw) -> httpx.Response:  # noqa: ANN001
    return http.post(f"{P}/add-checkpoint", content=body(old, run.proof(old, size), run.note(size, **kw)))


def register(http, run: Run) -> dict:  # noqa: ANN001
    r = http.post(f"{P}/logs", json={"manifest": run.manifest.decode()})
    assert r.status_code == 200, r.text
    return r.json()


def witness_key(http) -> NoteKey:  # noqa: ANN001
    return NoteKey.parse(http.get(f"{P}/key").json()["witness_vkey"])


def cosignature(r: httpx.Response) -> NoteSignature:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain") and r.text.endswith("\n")
    return NoteSignature.parse(r.text[:-1])


def test_the_key_names_the_witness_and_its_cosigner_key(http, tmp_path):
    served = http.get(f"{P}/key").json()
    key = NoteKey.parse(served["witness_vkey"])
    assert served["witness_name"] == NAME == key.name and key.alg == COSIGNATURE_V1
    assert key.public.hex() == served["public_key"]  # the beacon's key, as a cosigner key
    k = generate_key()
    default = TestClient(create_app(f"sqlite:///{tmp_path / 'd.db'}", k)).get(f"{P}/key").json()
    assert default["witness_name"] == "witness.beacon/" + public_hex(k.public_key())[:16]
    with pytest.raises(ValueError):
        Witness(k, "a name")


def test_a_log_registers_once_by_its_manifest(http):
    run = Run()
    first = register(http, run)
    assert first["origin"] == run.origin and first["origin_hash"] == origin_hash(run.origin)
    assert first["vkey"] == run.vkey.vkey() and first["size"] == 0 and not first["cosigned"]
    assert register(http, run) == first  # idempotent


@pytest.mark.parametrize("manifest", [
    '{"type":"manifest"}',  # no key
    '{"public_key":"%s","type":"step"}' % ("00" * 32),  # not a manifest
    '{"type": "manifest"}',  # not canonical
    '{"public_key":"%s","type":"manifest"}' % ("00" * 32),  # a weak key
    '{"public_key":"ab","type":"manifest\\u0000"}',
    "not json",
    "\x00",
])
def test_a_bad_manifest_is_a_400(http, manifest):
    r = http.post(f"{P}/logs", json={"manifest": manifest})
    assert r.status_code == 400 and r.json()["detail"]
    assert http.post(f"{P}/logs", json={"manifest": Run().manifest.decode(), "other": 1}).status_code == 400
    assert http.post(f"{P}/logs", json={"manifest": "x" * (1 << 20)}).status_code in (400, 413)


def test_a_checkpoint_is_cosigned_and_verifies_with_the_note_functions(http):
    run, wkey = Run(), witness_key(http)
    register(http, run)
    before = int(time.time())
    sig = cosignature(add(http, run, 0, 5))
    text = Checkpoint(run.origin, 5, run.log.root(5)).text()
    assert before <= verify_cosignature(text, sig, wkey) <= int(time.time())
    sig7 = cosignature(add(http, run, 5, 7))
    verify_cosignature(Checkpoint(run.origin, 7, run.log.root(7)).text(), sig7, wkey)
    # the monitoring path: the latest checkpoint with the log's signature and the witness's
    r = http.get(f"{P}/{origin_hash(run.origin)}/checkpoint")
    note = parse_note(r.content)
    assert Checkpoint.parse(note.text).size == 7 and verify_note_signature(note, run.vkey)
    assert note.signatures[-1] == sig7 and verify_cosignature(note.text, note.signatures[-1], wkey)
    logs = http.get(f"{P}/witness/logs", params={"key": public_hex(run.key.public_key())}).json()
    assert [(x["origin"], x["size"], x["cosigned"], x["forked"]) for x in logs] == [(run.origin, 7, True, False)]


def test_the_same_checkpoint_again_gets_its_first_cosignature(http):
    run, wkey = Run(), witness_key(http)
    register(http, run)
    witness = http.app.state.witness
    witness.clock = lambda: 1_700_000_000
    first = add(http, run, 0, 4).text
    witness.clock = lambda: 1_800_000_000
    again = add(http, run, 4, 4)
    assert again.text == first
    assert verify_cosignature(Checkpoint(run.origin, 4, run.log.root(4)).text(), cosignature(again), wkey) \
        == 1_700_000_000
    # a new checkpoint gets the new time
    assert verify_cosignature(Checkpoint(run.origin, 6, run.log.root(6)).text(), cosignature(add(http, run, 4, 6)),
                              wkey) == 1_800_000_000


def test_an_unregistered_origin_is_a_404(http):
    run = Run()
    assert add(http, run, 0, 3).status_code == 404  # a run origin, not registered
    other = Run()
    text = Checkpoint("example.com/log", 3, other.log.root(3)).text()
    note = Note(text, (sign_note(text, "example.com/log", other.key),)).encode()
    assert http.post(f"{P}/add-checkpoint", content=body(0, [], note)).status_code == 404  # not a run origin
    assert http.get(f"{P}/{origin_hash(run.origin)}/checkpoint").status_code == 404
    assert http.get(f"{P}/attempts/{origin_hash(run.origin)}").status_code == 404
    assert http.get(f"{P}/attempts/not-a-hash").status_code == 404


def test_a_checkpoint_without_the_logs_valid_signature_is_a_403(http):
    run = Run()
    register(http, run)
    assert add(http, run, 0, 3, signer=generate_key()).status_code == 403  # another key under the origin's name
    text = Checkpoint(run.origin, 3, run.log.root(3)).text()
    unknown = Note(text, (sign_note(text, "example.com/other", run.key),)).encode()
    assert http.post(f"{P}/add-checkpoint", content=body(0, [], unknown)).status_code == 403  # no line of the log
    good = sign_note(text, run.origin, run.key)
    bad = NoteSignature(good.name, good.key_id, bytes([good.sig[0] ^ 1]) + good.sig[1:])
    for sigs in ((bad,), (good, bad), (NoteSignature("x.example", b"abcd", b"zz"), bad)):
        r = http.post(f"{P}/add-checkpoint", content=body(0, [], Note(text, sigs).encode()))
        assert r.status_code == 403, sigs
    # lines of unknown keys beside the log's are ignored
    extra = Note(text, (sign_note(text, "example.com/other", generate_key()), good)).encode()
    assert http.post(f"{P}/add-checkpoint", content=body(0, [], extra)).status_code == 200


def test_malformed_requests_are_400s(http):
    run = Run()
    register(http, run)
    note = run.note(5)
    proof = [base64.b64encode(h) + b"\n" for h in run.log.tree.consistency_proof(3, 5)]
    bad = {
        "old over size": body(6, [], note),
        "leading zero": b"old 03\n" + b"".join(proof) + b"\n" + note,
        "no old line": b"\n" + note,
        "old with a plus": b"old +0\n\n" + note,
        "no empty line": b"old 0\n" + note,
        "64 proof lines": b"old 3\n" + proof[0] * 64 + b"\n" + note,
        "bad base64": b"old 3\nnot base64!\n\n" + note,
        "short hash": b"old 3\n" + base64.b64encode(b"x" * 31) + b"\n\n" + note,
        "note without blank line": b"old 0\n\n" + note.replace(b"\n\n", b"\n"),
        "an empty extension line": body(0, [], run.note(5, extensions=[""])),
        "leading-zero size": body(0, [], note.replace(b"\n5\n", b"\n05\n")),
        "a NUL": body(0, [], note.replace(b"\n5\n", b"\n5\x00\n")),
        "not UTF-8": body(0, [], note.replace(b"\n5\n", b"\n5\xff\n")),
        "a NUL in the old line": b"old 0\x00\n\n" + note,
    }
    for what, content in bad.items():
        r = http.post(f"{P}/add-checkpoint", content=content)
        assert r.status_code == 400, (what, r.status_code, r.text)
        assert r.json()["detail"]
    big = body(0, [], note) + b"x" * MAX_BODY
    assert http.post(f"{P}/add-checkpoint", content=big).status_code == 413
    assert http.get(f"{P}/witness/logs", params={"key": "zz"}).status_code == 400
    assert http.get(f"{P}/witness/logs", params={"key": "0" * 65}).status_code == 400


def test_an_old_size_that_is_not_the_latest_is_a_409_naming_it(http):
    run = Run()
    register(http, run)
    r = add(http, run, 3, 5)  # never cosigned: the latest is 0
    assert (r.status_code, r.text, r.headers["content-type"]) == (409, "0\n", "text/x.tlog.size")
    cosignature(add(http, run, 0, 5))
    for old in (0, 3, 4):
        r = add(http, run, old, 7)
        assert (r.status_code, r.text, r.headers["content-type"]) == (409, "5\n", "text/x.tlog.size")


def test_inconsistent_checkpoints_are_422s_and_the_first_fork_is_kept(http):
    run, forger = Run(), Run()
    register(http, run)
    empty = run.note(0, root=b"\x01" * 32)
    assert http.post(f"{P}/add-checkpoint", content=body(0, [], empty)).status_code == 422  # size 0, wrong root
    assert http.post(f"{P}/add-checkpoint", content=body(0, [b"\x00" * 32], run.note(5))).status_code == 422
    cosignature(add(http, run, 0, 5))
    assert http.post(f"{P}/add-checkpoint", content=body(5, [b"\x00" * 32], run.note(5))).status_code == 422
    # a consistency proof that does not verify: kept, as "proof"
    r = http.post(f"{P}/add-checkpoint", content=body(5, run.proof(5, 8), run.note(8, root=forger.log.root(8))))
    assert r.status_code == 422
    # a second root for the cosigned size: refused (409, as tlog-witness says), and not kept again (the first
    # fork stays)
    r = add(http, run, 5, 5, root=forger.log.root(5))
    assert r.status_code == 409 and r.text == "5\n" and r.headers["content-type"] == "text/x.tlog.size"
    r = add(http, run, 0, 5, root=forger.log.root(5))  # whatever the old size, it is one
    assert r.status_code == 409 and r.text == "5\n"
    log = http.get(f"{P}/witness/logs/{origin_hash(run.origin)}").json()
    assert log["forked"] and log["fork"]["kind"] == "proof" and log["fork"]["size"] == 8
    other, latest = parse_note(log["fork"]["other"].encode()), parse_note(log["fork"]["latest"].encode())
    assert verify_note_signature(other, run.vkey) and verify_note_signature(latest, run.vkey)
    assert Checkpoint.parse(other.text).root == forger.log.root(8) and Checkpoint.parse(latest.text).size == 5
    # the log's cosigned checkpoint is unchanged, and an honest next one is still cosigned
    assert parse_note(http.get(f"{P}/{origin_hash(run.origin)}/checkpoint").content).text == latest.text
    cosignature(add(http, run, 5, 9))


def test_a_second_root_for_the_latest_size_is_kept_as_proof_of_a_fork(http):
    run, forger = Run(), Run()
    register(http, run)
    cosignature(add(http, run, 0, 6))
    assert add(http, run, 6, 6, root=forger.log.root(6)).status_code == 409  # tlog-witness: 409 Conflict
    assert add(http, run, 6, 6, root=forger.log.root(7)).status_code == 409
    fork = http.get(f"{P}/witness/logs/{origin_hash(run.origin)}").json()["fork"]
    assert fork["kind"] == "root" and Checkpoint.parse(parse_note(fork["other"].encode()).text).root \
        == forger.log.root(6)


def both(calls: list) -> list:
    """What two calls return (or raise), each made in a thread of its own at the same time."""
    out: list = [None, None]

    def call(k: int) -> None:
        try:
            out[k] = calls[k]()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out[k] = e

    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _submit(witness: Witness, factory, content: bytes):  # noqa: ANN001, ANN202
    with factory() as s:
        return witness.add_checkpoint(s, content)


def _post(url: str, content: bytes, barrier: threading.Barrier) -> httpx.Response:
    with httpx.Client(base_url=url) as h:
        h.get(f"{P}/key")  # connected before the two requests start together
        barrier.wait()
        return h.post(f"{P}/add-checkpoint", content=content)


def _witness(backend: str, tmp_path, checked=lambda: None):  # noqa: ANN001
    engine = make_engine(_db(backend, tmp_path))
    create_tables(engine)
    return Witness(generate_key(), NAME, checked=checked), sessions(engine), engine


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.parametrize("fork", [False, True])
def test_of_two_requests_from_one_old_size_exactly_one_is_cosigned(backend, fork, tmp_path):
    """Both requests are held between their check and their update until both have checked (the race
    of tlog-witness's spec): the conditional update lets one through, the other gets a 409."""
    barrier = threading.Barrier(2, timeout=30)
    witness, factory, engine = _witness(backend, tmp_path, checked=barrier.wait)
    run = Run(records=64)
    with factory() as s:
        witness.register(s, run.manifest.decode())
    latest, base = 0, RunLog([run.manifest])
    for i in range(20):
        if fork:  # one size, two roots: the records cosigned so far, then one of two different records
            sides = [RunLog(base.lines) for _ in (0, 1)]
            for k, side in enumerate(sides):
                side.append({"type": "step", "step": i, "side": k})
            sizes = (len(base) + 1,) * 2
            bodies = [body(latest, side.tree.consistency_proof(latest, sizes[0]) if latest else [],
                           run.note(sizes[0], root=side.root())) for side in sides]
        else:
            sizes = (latest + 1, latest + 2)
            bodies = [body(latest, run.proof(latest, n), run.note(n)) for n in sizes]
        out = both([partial(_submit, witness, factory, b) for b in bodies])
        won = [k for k in (0, 1) if isinstance(out[k], str)]
        lost = [k for k in (0, 1) if isinstance(out[k], WitnessConflict)]
        assert len(won) == 1 and len(lost) == 1, (i, out)
        assert out[lost[0]].latest == sizes[won[0]]
        latest = sizes[won[0]]
        if fork:
            base = sides[won[0]]
        with factory() as s:
            row = s.query(WitnessLog).one()
            assert (row.size, row.cosignature) == (latest, out[won[0]])
        barrier.reset()
    with factory() as s:  # a fork raced in is kept once
        assert s.query(WitnessFork).count() == (1 if fork else 0)
    engine.dispose()


def test_the_attempts_note_prices_every_run_of_the_same_seed_whatever_its_recipe(http):
    first = Run()
    register(http, first)
    witness = NoteKey(witness_key(http).name, ED25519, witness_key(http).public)

    def attempts(run: Run) -> tuple[int, int, str, tuple[str, ...]]:
        r = http.get(f"{P}/attempts/{origin_hash(run.origin)}")
        note = parse_note(r.content)
        assert r.status_code == 200 and verify_note_signature(note, witness)
        lines = note.text.split("\n")
        assert lines[:2] == ["witness attempts/v2", run.origin]
        counted = AttemptsNote.parse(note.text)  # the priced runs named, each once
        assert counted.runs is not None and len(counted.runs) == counted.attempts
        return counted.others, counted.attempts, lines[2], counted.runs

    def rid(run: Run) -> str:
        return run_id(run.manifest).hex()

    assert attempts(first) == (0, 0, "0", ())
    cosignature(add(http, first, 0, 4))
    assert attempts(first) == (0, 0, "4", ())
    again = Run()  # the same seed and recipe under a fresh key: one computation, priced in
    register(http, again)
    assert attempts(first) == (1, 1, "4", (rid(again),)) and attempts(again) == (1, 1, "0", (rid(first),))
    # the same seed under another recipe (a field that may change no bit of the training): priced too
    inert = Run(grad_clip=1000.0)
    register(http, inert)
    assert attempts(first)[:2] == (2, 2) and attempts(first)[3] == tuple(sorted([rid(again), rid(inert)]))
    reseeded = Run(key=first.key, seed="22" * 32)  # the same key and recipe, another seed: linked, not priced
    register(http, reseeded)
    assert attempts(first)[:2] == (3, 2) and attempts(reseeded)[:2] == (3, 0)
    other = Run(seed="33" * 32, task="another")  # nothing shared
    register(http, other)
    assert attempts(first)[:2] == (3, 2) and attempts(other)[:2] == (0, 0)
    # a run the beacon answered (its heads streamed to POST heads) counts too, once if also registered
    beaconed = Run()
    sth = SignedTreeHead.sign(beaconed.key, 3, beaconed.log.root(3))
    r = http.post(f"{P}/heads", json={"tree_head": sth.to_json(), "manifest": beaconed.manifest.decode(),
                                       "consistency": [h.hex() for h in beaconed.log.tree.consistency_proof(1, 3)]})
    assert r.status_code == 200, r.text
    assert attempts(first)[:2] == (4, 3)
    register(http, beaconed)
    assert attempts(first)[:2] == (4, 3) and attempts(beaconed)[:2] == (4, 3)
    assert rid(beaconed) in attempts(first)[3]


def test_a_keys_logs_are_listed_a_page_at_a_time(http):
    key = generate_key()
    runs = [Run(key=key, seed=f"{i:02x}" * 32) for i in range(3)]
    for run in runs:
        register(http, run)
    hexkey = public_hex(key.public_key())
    page = http.get(f"{P}/witness/logs", params={"key": hexkey, "limit": 2}).json()
    rest = http.get(f"{P}/witness/logs", params={"key": hexkey, "limit": 2, "offset": 2}).json()
    assert len(page) == 2 and len(rest) == 1
    assert {x["origin"] for x in page + rest} == {r.origin for r in runs}
    assert http.get(f"{P}/witness/logs", params={"key": hexkey.upper()}).json() == http.get(
        f"{P}/witness/logs", params={"key": hexkey}).json()
    assert http.get(f"{P}/witness/logs", params={"key": public_hex(generate_key().public_key())}).json() == []
    assert http.get(f"{P}/witness/logs", params={"key": hexkey, "limit": 101}).status_code == 400


def test_the_client_registers_adds_and_checks_what_the_witness_signs(http):
    run = Run()
    client = WitnessClient(http, vkey=http.get(f"{P}/key").json()["witness_vkey"])
    assert client.register(run.manifest)["origin"] == run.origin
    sig = client.add_checkpoint(0, [], run.note(4))
    text = Checkpoint(run.origin, 4, run.log.root(4)).text()
    assert verify_cosignature(text, sig, client.key)
    # an answer lost and the request sent again: the 409 names this size, and the repeat's answer is the first
    assert client.add_checkpoint(0, [], run.note(4)) == sig
    with pytest.raises(WitnessError) as e:
        client.add_checkpoint(2, run.proof(2, 6), run.note(6))
    assert (e.value.status, e.value.latest) == (409, 4)
    with pytest.raises(WitnessError) as e:
        client.add_checkpoint(4, run.proof(4, 6), run.note(6, signer=generate_key()))
    assert e.value.status == 403 and e.value.latest is None
    sig6 = client.add_checkpoint(4, run.proof(4, 6), run.note(6))
    assert parse_note(client.checkpoint(run.origin)).signatures[-1] == sig6
    assert client.checkpoint(Run(seed="44" * 32).origin) is None
    assert client.attempts(run.origin)[:2] == (0, 0)
    with pytest.raises(WitnessError, match="pinned"):
        WitnessClient(http, vkey=NoteKey.of(NAME, generate_key().public_key(), COSIGNATURE_V1).vkey())


def test_the_leaderboard_mounts_the_witness(tmp_path):
    from lbhelpers import make_settings

    from witness.leaderboard.app import create_app as leaderboard_app

    with TestClient(leaderboard_app(make_settings("sqlite", tmp_path))) as client:
        run = Run()
        witness = WitnessClient(client)
        assert witness.key.public.hex() == client.get("/api/server-key").json()["public_key"]
        witness.register(run.manifest)
        sig = witness.add_checkpoint(0, [], run.note(3))
        assert witness.add_checkpoint(3, run.proof(3, 5), run.note(5)) != sig
        r = client.post(f"{P}/add-checkpoint", content=body(0, [], run.note(5)))
        assert (r.status_code, r.text, r.headers["content-type"]) == (409, "5\n", "text/x.tlog.size")
        assert witness.attempts(run.origin) == (0, 0, client.get(f"{P}/attempts/{origin_hash(run.origin)}").content)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("backend", "cosigner"), [("sqlite", "ml-dsa-44"), ("postgresql", "ed25519")])
def test_a_served_witness_cosigns_and_refuses_a_race_on_loopback(backend, cosigner, tmp_path):
    port, db = _free_port(), _db(backend, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "beacon", "serve", "--port", str(port), "--db", db,
                             "--key", str(tmp_path / "k.pem"), "--name", "witness.test/w1", "--cosigner", cosigner,
                             "--cosigner-key", str(tmp_path / "pq.pem")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout.readline().startswith("beacon public key ")
        line = proc.stdout.readline().split()
        assert line[:2] == ["witness", "witness.test/w1"]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + f"{P}/key").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        client = WitnessClient(url, vkey=line[-1])
        assert (client.key.alg, (tmp_path / "pq.pem").exists()) == ((0x06, True) if cosigner == "ml-dsa-44" else
                                                                    (0x04, False))
        run = Run(records=50)
        client.register(run.manifest)
        latest = 0
        for i in range(12):  # two requests from one old size at once: one 200, one 409, every time
            sizes, barrier = (latest + 1, latest + 2), threading.Barrier(2, timeout=30)
            out = both([partial(_post, url, body(latest, run.proof(latest, n), run.note(n)), barrier) for n in sizes])
            codes = sorted(r.status_code for r in out)
            assert codes == [200, 409], (i, [r.text for r in out])
            winner = next(k for k in (0, 1) if out[k].status_code == 200)
            assert next(r for r in out if r.status_code == 409).text == f"{sizes[winner]}\n"
            verify_cosignature(Checkpoint(run.origin, sizes[winner], run.log.root(sizes[winner])).text(),
                               cosignature(out[winner]), client.key)
            latest = sizes[winner]
        note = parse_note(client.checkpoint(run.origin))
        assert Checkpoint.parse(note.text).size == latest and verify_note_signature(note, run.vkey)
        assert client.attempts(run.origin)[:2] == (0, 0)
    finally:
        proc.terminate()
        proc.wait(10)


def test_beacon_serve_refuses_a_bad_witness_name(capsys):
    from witness.cli import main

    for name in ("a b", "a+b", ""):
        with pytest.raises(SystemExit):
            main(["beacon", "serve", "--name", name])
    assert "key name" in capsys.readouterr().err
    cosigner = NoteKey.of("operator.example/log", generate_key().public_key(), COSIGNATURE_V1).vkey()
    for vkey, why in (("not a vkey", "vkey"), (cosigner, "type 0x01")):  # --log: a log's note key
        with pytest.raises(SystemExit):
            main(["beacon", "serve", "--log", vkey])
        assert why in capsys.readouterr().err


def test_the_empty_tree_is_cosigned_once(http):
    run = Run()
    register(http, run)
    empty = run.note(0, root=EMPTY_ROOT)
    first = http.post(f"{P}/add-checkpoint", content=body(0, [], empty))
    assert first.status_code == 200
    assert http.post(f"{P}/add-checkpoint", content=body(0, [], empty)).text == first.text
    cosignature(add(http, run, 0, 3))


def test_extension_lines_are_cosigned_with_the_checkpoint(http):
    """tlog-checkpoint lets a log add extension lines; the witness cosigns the checkpoint with them (its
    cosignature/v1 message holds the whole text), and keeps them in the note it serves."""
    run = Run()
    register(http, run)
    ext = ["— not a signature", "key value"]
    sig = cosignature(add(http, run, 0, 5, extensions=ext))
    text = Checkpoint(run.origin, 5, run.log.root(5), tuple(ext)).text()
    assert verify_cosignature(text, sig, witness_key(http)) > 0
    with pytest.raises(Exception, match="does not verify"):  # not the checkpoint without them
        verify_cosignature(Checkpoint(run.origin, 5, run.log.root(5)).text(), sig, witness_key(http))
    served = parse_note(http.get(f"{P}/{origin_hash(run.origin)}/checkpoint").content)
    assert served.text == text


def test_a_witness_started_with_an_ml_dsa_44_key_cosigns_with_it(tmp_path):
    """``witness beacon serve --cosigner ml-dsa-44``: tlog-cosignature's type 0x06, served as its vkey;
    its attempts notes stay Ed25519 notes of the beacon's key; the client verifies its cosignatures."""
    from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

    from witness.commit.note import COSIGNATURE_MLDSA44

    beacon, pq = generate_key(), MLDSA44PrivateKey.generate()
    with TestClient(create_app(f"sqlite:///{tmp_path / 'pq.db'}", beacon, name=NAME, cosigner_key=pq)) as http:
        key = witness_key(http)
        assert key.alg == COSIGNATURE_MLDSA44 and key.public == pq.public_key().public_bytes_raw()
        run = Run()
        register(http, run)
        sig = cosignature(add(http, run, 0, 5))
        assert len(sig.sig) == 8 + 2420 and verify_cosignature(run.note(5).decode().split("\n\n")[0] + "\n", sig, key)
        client = WitnessClient(http, vkey=key.vkey())
        got = client.add_checkpoint(5, run.proof(5, 9), run.note(9))
        assert verify_cosignature(Checkpoint(run.origin, 9, run.log.root(9)).text(), got, key) > 0
        assert client.checkpoint(run.origin) is not None
        others, attempts, note = client.attempts(run.origin)  # signed by the ML-DSA-44 key: one key to pin
        from witness.commit.cosignature import verify_witness_note

        assert verify_witness_note(parse_note(note), key) and attempts == 0
        assert not verify_note_signature(parse_note(note), NoteKey.of(NAME, beacon.public_key()))


def _log_key(origin: str):  # noqa: ANN202
    key = generate_key()
    return key, NoteKey.of(origin, key.public_key())


def test_a_configured_log_is_cosigned_through_add_checkpoint_alone(tmp_path):
    """tlog-witness's model: the witness is configured with a long-lived log's key (``--log VKEY``, an
    operator's log) and cosigns its checkpoints; the client pinned to the witness's key speaks
    add-checkpoint and nothing else (no /key, no registration), as to any witness of the ecosystem."""
    origin = "operator.example/log"
    key, vkey = _log_key(origin)
    log = RunLog()
    for i in range(30):
        log.append({"type": "entry", "i": i})
    served = TestClient(create_app(f"sqlite:///{tmp_path / 'w.db'}", generate_key(), name=NAME, known=(vkey,)))
    with served as http:
        wkey = witness_key(http)
        asked: list[str] = []
        http.event_hooks = {"request": [lambda r: asked.append(r.url.path)]}

        def note(size: int, root: bytes | None = None, signer=key) -> bytes:  # noqa: ANN001
            text = Checkpoint(origin, size, log.root(size) if root is None else root).text()
            return Note(text, (sign_note(text, origin, signer),)).encode()

        client = WitnessClient(http, vkey=wkey.vkey(), ask_key=False)
        old = 0
        for size in (3, 10, 30):
            proof = log.tree.consistency_proof(old, size) if old else []
            sig = client.add_checkpoint(old, proof, note(size))
            assert verify_cosignature(Checkpoint(origin, size, log.root(size)).text(), sig, wkey) > 0
            old = size
        assert asked == [f"{P}/add-checkpoint"] * 3
        assert parse_note(http.get(f"{P}/{origin_hash(origin)}/checkpoint").content).text.startswith(origin + "\n30\n")
        # another key's checkpoint of the log, an unknown log, a fork: refused as for a run's log
        assert http.post(f"{P}/add-checkpoint", content=body(30, [], note(30, signer=generate_key()))).status_code == 403
        other = Checkpoint("operator.example/other", 1, log.root(1)).text()
        r = http.post(f"{P}/add-checkpoint", content=body(0, [], Note(other, (sign_note(other, origin, key),)).encode()))
        assert r.status_code == 404
        assert http.post(f"{P}/add-checkpoint", content=body(30, [], note(30, root=log.root(29)))).status_code in (409, 422)
        assert http.get(f"{P}/attempts/{origin_hash(origin)}").status_code == 404  # a log, not a run
    with pytest.raises(ValueError):  # a configured log's key is a note key named by a log's origin
        Witness(generate_key(), NAME, known=(NoteKey.of(origin, key.public_key(), COSIGNATURE_V1),))
    with pytest.raises(ValueError):
        Witness(generate_key(), NAME, known=(vkey, vkey))
    with pytest.raises(ValueError):
        WitnessClient("http://127.0.0.1:9", ask_key=False)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_parallel_forks_of_one_size_are_each_a_409_and_kept_once(backend, tmp_path, monkeypatch):
    """Two other roots for the cosigned size, sent at once: both reach the fork's record before either
    committed it (held there together); each is refused as a conflict, never a 500 (issue 52, item 1)."""
    witness, factory, engine = _witness(backend, tmp_path)
    run, forgers = Run(), (Run(), Run())
    with factory() as s:
        witness.register(s, run.manifest.decode())
    with factory() as s:
        witness.add_checkpoint(s, body(0, [], run.note(5)))
    barrier = threading.Barrier(2, timeout=30)
    keep = Witness._fork

    def together(self, *args):  # noqa: ANN001, ANN002, ANN202
        barrier.wait()
        return keep(self, *args)

    monkeypatch.setattr(Witness, "_fork", together)
    out = both([partial(_submit, witness, factory, body(5, [], run.note(5, root=f.log.root(5)))) for f in forgers])
    assert all(isinstance(o, WitnessConflict) and o.latest == 5 for o in out), out
    with factory() as s:
        assert s.query(WitnessFork).count() == 1
    engine.dispose()
