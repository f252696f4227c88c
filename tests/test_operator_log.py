"""An operator's log (``witness.beacon.operator``): many runs' registrations and heads in one long-lived
log, each checkpoint cosigned by witnesses configured for it and spoken to through add-checkpoint
alone; every head's inclusion in the checkpoint that answers it, consistency between checkpoints, the
runs of one seed readable from the entries, and the refusals a dishonest trainer meets."""

from __future__ import annotations

import threading

import pytest
from starlette.testclient import TestClient

from witness.beacon.app import create_app as witness_app
from witness.beacon.operator import OperatorLog
from witness.beacon.operator_app import create_app
from witness.beacon.operator_db import create_tables
from witness.beacon.witness_client import WitnessClient
from witness.commit.beacon import run_id
from witness.commit.cosignature import verify_cosignature
from witness.commit.log import RunLog
from witness.commit.merkle import MerkleTree, root_from_inclusion, verify_consistency
from witness.commit.note import Checkpoint, Note, NoteKey, parse_note, run_origin, sign_note
from witness.commit.operator import (
    HeadEntry,
    RunEntry,
    entry_leaf,
    parse_entry,
    run_entry,
    seed_tag,
)
from witness.commit.signing import generate_key, public_hex
from witness.database import make_engine, sessions
from witness.errors import MalformedInput

ORIGIN = "operator.example/log"
P = "/api/operator"


class Run:
    """A run's log and key; its checkpoints as the notes an operator log's head entries hold."""

    def __init__(self, seed: str = "11" * 32, records: int = 30):
        self.key = generate_key()
        self.log = RunLog()
        self.log.append({"type": "manifest", "public_key": public_hex(self.key.public_key()), "run_seed": seed})
        for i in range(1, records):
            self.log.append({"type": "step", "step": i - 1})
        self.manifest = self.log.lines[0]
        self.id = run_id(self.manifest)
        self.origin = run_origin(self.id)

    def note(self, size: int, key=None, root: bytes | None = None) -> str:  # noqa: ANN001
        text = Checkpoint(self.origin, size, self.log.root(size) if root is None else root).text()
        return Note(text, (sign_note(text, self.origin, key or self.key),)).encode().decode()

    def head(self, http, size: int, old: int = 0, **kw):  # noqa: ANN001, ANN201
        proof = self.log.tree.consistency_proof(old, size) if 0 < old < size else []
        return http.post(f"{P}/heads", json={"run": self.id.hex(), "checkpoint": self.note(size, **kw), "old": old,
                                             "proof": [h.hex() for h in proof]})


@pytest.fixture
def world(tmp_path):
    """Two witnesses configured for the log (our own witness server), and the operator log's app."""
    key = generate_key()
    vkey = NoteKey.of(ORIGIN, key.public_key())
    witnesses = [TestClient(witness_app(f"sqlite:///{tmp_path / f'w{i}.db'}", generate_key(), name=f"w{i}.example",
                                        known=(vkey,))) for i in (1, 2)]
    for w in witnesses:
        w.__enter__()
    keys = [NoteKey.parse(w.get("/api/beacon/key").json()["witness_vkey"]) for w in witnesses]
    engine = make_engine(f"sqlite:///{tmp_path / 'op.db'}")
    create_tables(engine)
    clients = [WitnessClient(w, vkey=k.vkey(), ask_key=False) for w, k in zip(witnesses, keys, strict=True)]
    log = OperatorLog(sessions(engine), key, ORIGIN, clients)
    with TestClient(create_app(log)) as http:
        yield {"http": http, "log": log, "keys": keys, "vkey": vkey, "engine": engine, "key": key,
               "witnesses": witnesses, "clients": clients}
    for w in witnesses:
        w.__exit__(None, None, None)


def _checked(answer: dict, world: dict, entry: bytes) -> Checkpoint:
    """The answer's checkpoint, its log signature and both cosignatures verified, the entry included."""
    note = parse_note(answer["checkpoint"].encode())
    cp = Checkpoint.parse(note.text)
    assert cp.origin == ORIGIN and note.of_key(world["vkey"])
    for k in world["keys"]:
        assert [verify_cosignature(note.text, s, k) for s in note.of_key(k)]
    proof = [bytes.fromhex(h) for h in answer["inclusion"]]
    assert root_from_inclusion(entry_leaf(entry), answer["index"], cp.size, proof) == cp.root
    return cp


def test_runs_share_one_log_and_each_head_is_included_in_a_cosigned_checkpoint(world):
    http = world["http"]
    a, b, again = Run(), Run(seed="22" * 32), Run()  # `again`: a restart under a's seed
    reg = {r: http.post(f"{P}/runs", json={"manifest": r.manifest.decode()}).json() for r in (a, b, again)}
    assert [reg[r]["index"] for r in (a, b, again)] == [0, 1, 2]
    assert http.post(f"{P}/runs", json={"manifest": a.manifest.decode()}).json() == reg[a]  # the same run again
    checkpoints = []
    for run, old, size in ((a, 0, 5), (b, 0, 3), (a, 5, 9), (b, 3, 20), (a, 9, 30)):
        r = run.head(http, size, old)
        assert r.status_code == 200, r.text
        entry = HeadEntry(run.id, run.note(size).encode(), Checkpoint(run.origin, size, run.log.root(size))).entry()
        checkpoints.append(_checked(r.json(), world, entry))
    # every checkpoint extends the one before it, as the witnesses checked
    for old, new in zip(checkpoints, checkpoints[1:], strict=False):
        proof = http.get(f"{P}/consistency", params={"old": old.size, "new": new.size}).json()["proof"]
        verify_consistency(old.size, new.size, old.root, new.root, [bytes.fromhex(h) for h in proof])
    # anyone reads the entries, rebuilds the latest cosigned root, and sees both runs of a's seed
    latest = parse_note(http.get(f"{P}/checkpoint").content)
    cp = Checkpoint.parse(latest.text)
    entries = http.get(f"{P}/entries", params={"start": 0}).json()["entries"]
    assert MerkleTree([entry_leaf(e.encode()) for e in entries[:cp.size]]).root() == cp.root
    parsed = [parse_entry(e.encode()) for e in entries]
    tags = [(e.run, e.seed_tag) for e in parsed if isinstance(e, RunEntry)]
    for seed, runs in (("11" * 32, 2), ("22" * 32, 1)):  # who knows a seed finds its runs; the log shows no seed
        assert sum(t == seed_tag(bytes.fromhex(seed), r) for r, t in tags) == runs
        assert all(seed not in e for e in entries)
    assert http.get(f"{P}/key").json()["vkey"] == world["vkey"].vkey()


def test_a_dishonest_trainers_heads_are_refused(world):
    http = world["http"]
    run, stranger = Run(), Run()
    http.post(f"{P}/runs", json={"manifest": run.manifest.decode()})
    assert stranger.head(http, 5).status_code == 404  # not registered
    assert run.head(http, 5, key=generate_key()).status_code == 403  # another key's signature
    assert run.head(http, 9, old=3).status_code == 409  # not from its latest head here (none yet: 0)
    first = run.head(http, 5).json()["index"]
    assert run.head(http, 5, old=5).json()["index"] == first  # the same head again: its index
    assert run.head(http, 9, old=5).status_code == 200
    assert run.head(http, 5).json()["index"] == first  # sent again after the answer was lost: its index still
    other = RunLog([run.log.lines[0], b'{"step":0,"type":"forged"}'] + run.log.lines[2:])
    assert run.head(http, 13, old=9, root=other.root(13)).status_code == 422  # a fork of the run's log
    assert run.head(http, 9, old=9, root=other.root(9)).status_code == 422  # another root for its size
    bad = http.post(f"{P}/heads", json={"run": run.id.hex(), "checkpoint": Run().note(5), "old": 5, "proof": []})
    assert bad.status_code == 400  # another run's checkpoint under this run's name
    for body in ({"run": "zz", "checkpoint": run.note(5), "old": 0}, {"run": run.id.hex(), "checkpoint": "x", "old": 0},
                 {"run": run.id.hex(), "checkpoint": run.note(5), "old": -1}):
        assert http.post(f"{P}/heads", json=body).status_code in (400, 422)
    assert http.post(f"{P}/runs", json={"manifest": '{"type":"step"}'}).status_code == 400
    with pytest.raises(MalformedInput):
        parse_entry(b'{"type":"head"}')


def test_a_checkpoint_short_of_its_quorum_is_not_answered(world, tmp_path):
    """A witness that is down: with both required no head is answered (503, nothing claimed cosigned);
    with one of two required it is; the tree reloads from the tables after a restart."""
    http, log = world["http"], world["log"]
    run = Run()
    http.post(f"{P}/runs", json={"manifest": run.manifest.decode()})
    world["witnesses"][1].__exit__(None, None, None)
    down = TestClient(witness_app(f"sqlite:///{tmp_path / 'down.db'}", generate_key(), name="w2.example"))
    log.witnesses[1] = WitnessClient(down, vkey=world["keys"][1].vkey(), ask_key=False, retries=0)
    r = run.head(http, 5)
    assert r.status_code == 503 and "1 of the 2" in r.json()["detail"]
    log.required = 1
    r = run.head(http, 5, old=5)
    assert r.status_code == 200
    assert len(parse_note(r.json()["checkpoint"].encode()).signatures) == 2  # the log's and one witness's
    again = OperatorLog(sessions(world["engine"]), world["key"], ORIGIN, world["clients"][:1])
    assert again.tree.size == log.tree.size and again.tree.root() == log.tree.root()
    world["witnesses"][1].__enter__()


def test_heads_of_runs_racing_one_another_each_get_a_checkpoint_that_holds_them(world):
    http = world["http"]
    runs = [Run(seed=f"{i:02x}" * 32) for i in range(6)]
    for r in runs:
        http.post(f"{P}/runs", json={"manifest": r.manifest.decode()})
    out: dict[int, dict] = {}
    barrier = threading.Barrier(len(runs), timeout=30)

    def send(i: int) -> None:
        barrier.wait()
        out[i] = runs[i].head(http, 10).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(a["index"] for a in out.values()) == list(range(len(runs), 2 * len(runs)))
    for i, a in out.items():
        entry = HeadEntry(runs[i].id, runs[i].note(10).encode(), Checkpoint(runs[i].origin, 10, runs[i].log.root(10)))
        _checked(a, world, entry.entry())


def _serve(args: list[str], tmp_path, name: str):  # noqa: ANN202 - (process, url, first stdout lines)
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", *args, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=open(tmp_path / f"{name}.err", "w"), text=True,  # noqa: SIM115
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/docs", timeout=2)
            return proc, url, lines
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / f"{name}.err").read_text()
            time.sleep(0.1)


def test_the_commands_deploy_an_operator_log_its_witness_cosigns(tmp_path):
    """``witness beacon serve --log VKEY`` and ``witness operator serve --witness URL=VKEY``, as a lab
    deploys them: the witness learns the log from its configuration alone, the log speaks to it through
    add-checkpoint, and a run's head comes back included in a checkpoint the witness cosigned."""
    import httpx

    from witness.commit.signing import save_key

    op_key = generate_key()
    save_key(op_key, tmp_path / "op.pem")
    vkey = NoteKey.of(ORIGIN, op_key.public_key()).vkey()
    procs = []
    try:
        w, wurl, wlines = _serve(["beacon", "serve", "--db", str(tmp_path / "w.db"), "--key", str(tmp_path / "w.pem"),
                                  "--name", "w1.example", "--log", vkey], tmp_path, "w")
        procs.append(w)
        wkey = wlines[1].split()[-1]
        o, ourl, olines = _serve(["operator", "serve", "--origin", ORIGIN, "--key", str(tmp_path / "op.pem"), "--db",
                                  str(tmp_path / "op.db"), "--witness", f"{wurl}/api/beacon={wkey}"], tmp_path, "o")
        procs.append(o)
        assert olines[0].split()[-1] == vkey
        run = Run()
        assert httpx.post(f"{ourl}{P}/runs", json={"manifest": run.manifest.decode()}).status_code == 200
        r = run.head(httpx.Client(base_url=ourl, timeout=30), 7)
        assert r.status_code == 200, r.text
        note = parse_note(r.json()["checkpoint"].encode())
        assert [verify_cosignature(note.text, s, NoteKey.parse(wkey)) for s in note.of_key(NoteKey.parse(wkey))]
        assert httpx.get(f"{wurl}/api/beacon/key").status_code == 200  # (the witness's own route, not the log's)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)


def test_the_verifiers_streaming_root_is_rfc_6962s():
    from witness.commit.hashing import leaf_hash
    from witness.verify.operator import _StreamingRoot

    for n in range(0, 70):
        leaves = [leaf_hash(bytes([i])) for i in range(n)]
        streamed = _StreamingRoot()
        for h in leaves:
            streamed.add(h)
        assert streamed.root() == MerkleTree(leaves).root(), n


def test_a_run_registered_after_its_first_head_is_refused_and_strangers_are_not_counted():
    """A trainer that is its own operator could enter its restarts' heads unregistered and register only
    the one it presents: a run must be registered before its first head. And a run of the seed counts
    only where its tag is the seed's (a stranger, not knowing the seed, cannot make one)."""
    from witness.verify.operator import OperatorChain, OperatorTrust

    run, stranger = Run(seed="33" * 32), Run(seed="44" * 32)
    reg = run_entry(run.manifest)
    head = HeadEntry(run.id, run.note(5).encode(), Checkpoint(run.origin, 5, run.log.root(5)))
    copied = RunEntry(stranger.id, reg.public_key, reg.seed_tag)  # the victim's tag under another run's id
    for order, ok in (([reg.entry(), copied.entry(), head.entry()], True), ([head.entry(), reg.entry()], False)):
        tree = MerkleTree([entry_leaf(e) for e in order])
        chain = OperatorChain(OperatorTrust(NoteKey.of(ORIGIN, generate_key().public_key()), lambda i, o=order: o[i:]),
                              run.id, reg.public_key, bytes.fromhex("33" * 32), lambda size, root: True, 40)
        chain.last = Checkpoint(ORIGIN, tree.size, tree.root())
        if ok:
            assert chain.attempts() == (0, 0, None)  # the copied tag is not the seed's under the stranger's id
        else:
            with pytest.raises(Exception, match="no registration of this run before its first head"):
                chain.attempts()


def test_a_resumed_run_whose_heads_went_further_than_it_kept_goes_on_from_the_logs_latest(world):
    """A run killed after the operator took heads it never kept resumes from its last kept window: the
    operator names the run's latest head (409 with it), and the link proves the next head from there."""
    from types import SimpleNamespace

    from witness.beacon.operator_link import OperatorClient, OperatorLink

    http = world["http"]
    run = Run()
    http.post(f"{P}/runs", json={"manifest": run.manifest.decode()})
    assert run.head(http, 5).status_code == 200 and run.head(http, 9, old=5).status_code == 200
    link = OperatorLink(OperatorClient(http), SimpleNamespace(chain=None))  # (no round is fetched here)
    link.resume_at(5)
    answer = link.enter(run.id, run.note(13).encode(), run.log, 13)
    entry = HeadEntry(run.id, run.note(13).encode(), Checkpoint(run.origin, 13, run.log.root(13))).entry()
    _checked(answer, world, entry)
    assert link.enter(run.id, run.note(13).encode(), run.log, 13)["index"] == answer["index"]  # sent again
