"""Runs witnessed through an operator's log by witnesses written here from the C2SP specs alone
(tlog-witness, tlog-cosignature, signed-note, tlog-checkpoint): one route, ``POST /add-checkpoint``,
the operator log's key configured in advance and no other route, none of the witness servers of this
package. An honest run through two of them is accepted; a fork shown to them is refused; and the
windows a dishonest trainer (or operator, or one colluding witness) can make are refused or not counted."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from witness.beacon.drand import LocalDrand
from witness.beacon.drand import create_app as drand_app
from witness.beacon.operator import OperatorLog
from witness.beacon.operator_app import create_app as operator_app
from witness.beacon.operator_db import create_tables
from witness.beacon.operator_link import OperatorLink
from witness.beacon.witness_client import WitnessClient
from witness.bundle.layout import STATEMENTS
from witness.cli import main
from witness.commit.drand import round_after, round_time
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.merkle import MerkleTree
from witness.commit.note import Checkpoint, Note, NoteKey, NoteSignature, parse_note, sign_note
from witness.commit.operator import entry_leaf, head_entry
from witness.commit.signing import generate_key, load_key, save_key
from witness.database import make_engine, sessions
from witness.web import start_uvicorn, stop_uvicorn

STEPS, P, EVERY = 16, 0.25, 4
ORIGIN = "operator.example/spec-runs"


# --- a tlog-witness from the specs alone ---------------------------------------------------------------------

def _b64(text: str, size: int | None = None) -> bytes:
    raw = base64.b64decode(text, validate=True)
    if base64.b64encode(raw).decode() != text or (size is not None and len(raw) != size):
        raise ValueError("not a canonical base64 hash")
    return raw


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _consistent(first: int, second: int, first_root: bytes, second_root: bytes, proof: list[bytes]) -> bool:
    """RFC 9162 2.1.4.2: whether ``proof`` shows the tree of ``first`` leaves a prefix of the one of ``second``."""
    if first == second:
        return not proof and first_root == second_root
    if first == 0:
        return not proof
    if first > second or not proof:
        return False
    path = [first_root, *proof] if first & (first - 1) == 0 else list(proof)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = _node(c, fr), _node(c, sr)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = _node(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == first_root and sr == second_root


def _parse(body: bytes) -> tuple[int, list[bytes], str, int, bytes, bytes, list[tuple[str, bytes]]]:
    """An add-checkpoint body: old size, proof, and the checkpoint (origin, size, root, text, signature lines)."""
    head, _, note = body.partition(b"\n\n")  # the header's lines are never empty, the checkpoint's origin neither
    lines = head.decode("ascii").split("\n")
    old = re.fullmatch(r"old (0|[1-9][0-9]*)", lines[0])
    if old is None or len(lines) > 64:
        raise ValueError("no old size line")
    proof = [_b64(h, 32) for h in lines[1:]]
    split = note.rfind(b"\n\n")
    text, block = note[:split + 1], note[split + 2:].decode("utf-8")
    fields = text.decode("utf-8").split("\n")[:-1]
    if split < 0 or len(fields) < 3 or not re.fullmatch(r"0|[1-9][0-9]*", fields[1]) or not block.endswith("\n"):
        raise ValueError("not a signed checkpoint")
    sigs = []
    for line in block[:-1].split("\n"):
        name, _, sig = line.removeprefix("— ").partition(" ")
        if not line.startswith("— ") or not name:
            raise ValueError("not a signature line")
        sigs.append((name, _b64(sig)))
    return int(old[1]), proof, fields[0], int(fields[1]), _b64(fields[2], 32), text, sigs


class SpecWitness:
    """A witness of the logs ``logs`` (origin: raw Ed25519 key), configured in advance; it keeps the latest
    checkpoint it cosigned of each. ``backdate``: seconds taken off its cosignatures' time (a colluding witness)."""

    def __init__(self, name: str, logs: dict[str, bytes], key: Ed25519PrivateKey | None = None, backdate: int = 0):
        self.name, self.logs, self.backdate = name, dict(logs), backdate
        self.key = key or Ed25519PrivateKey.generate()
        self.public = self.key.public_key().public_bytes_raw()
        self.id = hashlib.sha256(name.encode() + b"\n\x04" + self.public).digest()[:4]  # cosignature/v1's key ID
        self.latest: dict[str, tuple[int, bytes]] = {}
        self.lock = threading.Lock()

    def vkey(self) -> str:
        typed = base64.b64encode(b"\x04" + self.public).decode()
        return f"{self.name}+{self.id.hex()}+{typed}"

    def add_checkpoint(self, body: bytes) -> tuple[int, bytes, str]:
        """tlog-witness's add-checkpoint: (status, body, content type)."""
        try:
            old, proof, origin, size, root, text, sigs = _parse(body)
        except (ValueError, UnicodeDecodeError, binascii.Error):
            return 400, b"malformed request\n", "text/plain"
        if origin not in self.logs:
            return 404, b"unknown log\n", "text/plain"
        public = self.logs[origin]
        log_id = hashlib.sha256(origin.encode() + b"\n\x01" + public).digest()[:4]

        def verifies(sig: bytes) -> bool:
            try:
                Ed25519PublicKey.from_public_bytes(public).verify(sig, text)
                return True
            except InvalidSignature:
                return False

        if not any(name == origin and raw[:4] == log_id and verifies(raw[4:]) for name, raw in sigs):
            return 403, b"no signature of the log's key verifies\n", "text/plain"
        if old > size:
            return 400, b"old size beyond the checkpoint\n", "text/plain"
        with self.lock:  # the check and the update, atomically
            latest, latest_root = self.latest.get(origin, (0, b""))
            if old != latest or (old == size and old and root != latest_root):
                return 409, f"{latest}\n".encode(), "text/x.tlog.size"
            if not _consistent(old, size, latest_root if old else b"", root, proof):
                return 422, b"the consistency proof does not verify\n", "text/plain"
            self.latest[origin] = (size, root)
            t = int(time.time()) - self.backdate
            sig = self.key.sign(b"cosignature/v1\ntime %d\n" % t + text)
        line = f"— {self.name} {base64.b64encode(self.id + t.to_bytes(8, 'big') + sig).decode()}\n"
        return 200, line.encode(), "text/plain"


def spec_app(w: SpecWitness) -> Starlette:
    async def add(request):  # noqa: ANN001, ANN202
        status, content, media = w.add_checkpoint(await request.body())
        return Response(content, status, headers={"Content-Type": media})

    return Starlette(routes=[Route("/add-checkpoint", add, methods=["POST"])])


# --- a deployment on loopback ------------------------------------------------------------------------------

class Deployment:
    """A local drand chain, two spec-only witnesses configured for the operator's log, and the log."""

    def __init__(self, folder: Path, backdate: tuple[int, int] = (0, 0)):
        self.drand = LocalDrand(seed=b"\x33" * 32, period=1)
        self.info = folder / "chain-info.json"
        self.info.write_text(json.dumps(self.drand.chain.to_json()))
        self.op_key = generate_key()
        self.vkey = NoteKey.of(ORIGIN, self.op_key.public_key())
        known = {ORIGIN: self.op_key.public_key().public_bytes_raw()}
        self.witnesses = [SpecWitness(f"w{i + 1}.example", known, backdate=b) for i, b in enumerate(backdate)]
        self.servers = [start_uvicorn(drand_app(self.drand))] + [start_uvicorn(spec_app(w)) for w in self.witnesses]
        self.urls = [s[2] for s in self.servers[1:]]
        engine = make_engine(f"sqlite:///{folder / 'op.db'}")
        create_tables(engine)
        pinned = [WitnessClient(u, vkey=w.vkey(), prefix="", ask_key=False) for u, w in zip(self.urls, self.witnesses,
                                                                                             strict=True)]
        self.log = OperatorLog(sessions(engine), self.op_key, ORIGIN, pinned)
        self.servers.append(start_uvicorn(operator_app(self.log)))
        self.drand_url, self.operator_url = self.servers[0][2], self.servers[-1][2]

    def train(self, out: Path, seed: str) -> Path:
        save_key(generate_key(), out.parent / f"{out.name}.key")
        assert main(["train", "--task", "tiny", "--steps", str(STEPS), "--out", str(out), "--key",
                     str(out.parent / f"{out.name}.key"), "--quiet", "--no-self-check", "--online-p", str(P),
                     "--online-every", str(EVERY), "--drand", self.drand_url, "--drand-chain", str(self.info),
                     "--operator", self.operator_url, "--seed", seed, "--beacon-patience", "20"]) == 0
        return out

    def verify(self, bundle: Path, capsys, *extra: str) -> tuple[int, dict]:
        args = ["verify", "--allow-weak", str(bundle), "--mode", "online", "--drand", str(self.info), "--bad-fraction",
                "0.5", "--json", "--operator", self.vkey.vkey(), "--operator-url", self.operator_url, *extra]
        for w in self.witnesses:
            args += ["--witness", f"{w.name}={w.public.hex()}"]
        code = main(args)
        out = capsys.readouterr().out.strip()
        return code, json.loads(out.splitlines()[-1]) if out else {}

    def entries(self) -> list[bytes]:
        return [e.encode() for e in self.log.entries(0, 1 << 20)]

    def close(self) -> None:
        for server, thread, _ in self.servers:
            stop_uvicorn(server, thread)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("spec"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def honest(deployed, tmp_path_factory):
    return deployed.train(tmp_path_factory.mktemp("honest") / "b", seed="41")


def _windows(bundle: Path) -> list[dict]:
    return [parse_canonical_json(line) for line in (bundle / STATEMENTS).read_bytes().splitlines()]


def _rewrite(bundle: Path, tmp_path: Path, change) -> Path:  # noqa: ANN001
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    objs = _windows(out)
    change(objs)
    (out / STATEMENTS).write_bytes(b"".join(canonical_json(o) + b"\n" for o in objs))
    return out


def _op_note(tree: MerkleTree, key: Ed25519PrivateKey, size: int | None = None) -> Note:
    text = Checkpoint(ORIGIN, size or tree.size, tree.root(size or tree.size)).text()
    return Note(text, (sign_note(text, ORIGIN, key),))


def _post(url: str, old: int, proof: list[bytes], note: bytes) -> httpx.Response:
    body = f"old {old}\n".encode() + b"".join(base64.b64encode(h) + b"\n" for h in proof) + b"\n" + note
    return httpx.post(f"{url}/add-checkpoint", content=body, timeout=10)


def _early(self: OperatorLink) -> int:
    """The next round: due within a period of the cosignatures that follow (a round the trainer could know)."""
    return round_after(self.chain, time.time())


def test_a_run_witnessed_by_two_spec_only_witnesses_is_accepted(deployed, honest, capsys):
    """Nothing attacked: the operator log's checkpoints, cosigned by the spec-only witnesses, carry the run."""
    windows = _windows(honest)
    assert len(windows) >= STEPS // EVERY and all("operator" in w for w in windows)
    for w in windows:
        note = parse_note(w["operator"]["checkpoint"].encode())
        for sw in deployed.witnesses:
            lines = [s for s in note.signatures if s.name == sw.name and s.key_id == sw.id]
            assert len(lines) == 1
            t = int.from_bytes(lines[0].sig[:8], "big")
            assert t + deployed.drand.chain.period < round_time(deployed.drand.chain, w["round"])
    latest = Checkpoint.parse(parse_note(deployed.log.latest().note.encode()).text)
    assert all(sw.latest[ORIGIN] == (latest.size, latest.root) for sw in deployed.witnesses)
    code, v = deployed.verify(honest, capsys)
    assert code == 0 and v["accepted"], v
    online = v["online"]
    assert online["final"] and online["unaudited"] == 0 and online["attempts"] == 0, online
    assert f"through the operator log {ORIGIN}" in online["witnessed"] and "w2.example" in online["witnessed"]


def test_the_spec_witness_refuses_what_tlog_witness_says_it_must(deployed, honest):
    """The witness itself: an unknown origin, a signature by another key, malformed bodies and an old size past
    the checkpoint are refused with tlog-witness's codes, and none of them moves its latest checkpoint."""
    url, w = deployed.urls[0], deployed.witnesses[0]
    before = dict(w.latest)
    tree = MerkleTree([entry_leaf(e) for e in deployed.entries()])
    size = w.latest[ORIGIN][0]
    stranger = generate_key()
    text = Checkpoint("other.example/log", size, tree.root(size)).text()
    other = Note(text, (sign_note(text, "other.example/log", stranger),)).encode()
    assert _post(url, size, [], other).status_code == 404
    assert _post(url, size, [], _op_note(tree, stranger, size).encode()).status_code == 403
    good = _op_note(tree, deployed.op_key, size).encode()
    assert _post(url, size + 1, [], good).status_code == 400  # old past the checkpoint
    for body in (b"old 01\n\n" + good, b"old x\n\n" + good, b"old 0\nnot base64!\n\n" + good, b"garbage"):
        assert httpx.post(f"{url}/add-checkpoint", content=body, timeout=10).status_code == 400, body
    again = _post(url, size, [], good)  # the checkpoint it holds, sent again: cosigned again, nothing moved
    assert again.status_code == 200 and again.text.startswith(f"— {w.name} ")
    assert w.latest == before
    assert httpx.get(f"{url}/checkpoint", timeout=10).status_code in (404, 405)  # no other route


def test_a_fork_of_one_window_shown_to_the_two_witnesses_is_refused(deployed, honest, tmp_path, capsys):
    """The operator signs a second version of its log: at the size the witnesses hold (another root), past it
    (a proof from another root), and one holding the run's first head at another place. Both witnesses
    refuse every one; and a window whose operator checkpoint is the fork, without their cosignatures or
    with the honest checkpoint's pasted on, is refused by the verifier."""
    entries = deployed.entries()
    n, root = deployed.witnesses[0].latest[ORIGIN]
    assert MerkleTree([entry_leaf(e) for e in entries]).root(n) == root
    fork = MerkleTree([entry_leaf(e) for e in entries[:n - 1]] + [entry_leaf(b'{"fork":1}')])
    same_size = _op_note(fork, deployed.op_key).encode()
    fork.append(entry_leaf(b'{"fork":2}'))
    past = _op_note(fork, deployed.op_key).encode()
    w0 = _windows(honest)[0]
    i0 = w0["operator"]["index"]
    head = entry_leaf(head_entry(bytes.fromhex(w0["run"]), w0["checkpoint"].encode()).entry())
    moved = MerkleTree([entry_leaf(e) for e in entries[:i0]] + [entry_leaf(b'{"fork":3}'), head])
    moved_note = _op_note(moved, deployed.op_key)
    for url, w in zip(deployed.urls, deployed.witnesses, strict=True):
        r = _post(url, n, [], same_size)
        assert r.status_code == 409 and r.headers["content-type"] == "text/x.tlog.size" and r.text == f"{n}\n"
        r = _post(url, n, fork.consistency_proof(n, n + 1), past)
        assert r.status_code == 422 and "—" not in r.text
        r = _post(url, 0, [], moved_note.encode())
        assert r.status_code == 409 and r.text == f"{n}\n"
        assert w.latest[ORIGIN] == (n, root)

    def forked(objs: list[dict]) -> None:
        objs[0]["operator"] = {"checkpoint": moved_note.encode().decode(), "index": i0 + 1, "consistency": [],
                               "inclusion": [h.hex() for h in moved.inclusion_proof(i0 + 1, moved.size)]}

    code, v = deployed.verify(_rewrite(honest, tmp_path / "a", forked), capsys)
    assert code == 1 and not v["accepted"]
    assert any("cosigned by 0 of the 2" in f for f in v["failures"]), v["failures"]
    honest_sigs = parse_note(w0["operator"]["checkpoint"].encode()).signatures[1:]

    def pasted(objs: list[dict]) -> None:
        forked(objs)
        objs[0]["operator"]["checkpoint"] = Note(moved_note.text, moved_note.signatures + honest_sigs).encode().decode()

    code, v = deployed.verify(_rewrite(honest, tmp_path / "b", pasted), capsys)
    assert code == 1 and any("does not verify" in f for f in v["failures"]), v["failures"]


def test_a_head_left_out_of_the_operator_log_is_refused(deployed, honest, tmp_path, capsys):
    """A window whose run checkpoint, signed by the run's key, was never entered in the operator log (the
    same head with one more signature line), or whose operator proof is the window before's (a checkpoint
    cosigned before the head was entered): its head is not the entry the operator checkpoint holds."""
    run_key = load_key(honest.parent / "b.key")
    stranger = generate_key()

    def unentered(objs: list[dict]) -> None:
        note = parse_note(objs[1]["checkpoint"].encode())
        assert sign_note(note.text, note.signatures[0].name, run_key) == note.signatures[0]  # the run's key
        extra = sign_note(note.text, "other.example", stranger)
        objs[1]["checkpoint"] = Note(note.text, (*note.signatures, extra)).encode().decode()

    code, v = deployed.verify(_rewrite(honest, tmp_path / "a", unentered), capsys)
    assert code == 1 and any("is not entry" in f for f in v["failures"]), v["failures"]

    def earlier(objs: list[dict]) -> None:
        objs[2]["operator"] = dict(objs[1]["operator"], consistency=[])

    code, v = deployed.verify(_rewrite(honest, tmp_path / "b", earlier), capsys)
    assert code == 1 and any("is not entry" in f for f in v["failures"]), v["failures"]


def test_an_operator_checkpoint_inconsistent_with_an_earlier_one_is_refused(deployed, honest, tmp_path, capsys):
    """The operator rewrites an entry the window before's checkpoint holds and has the fork cosigned by both
    witnesses' keys (colluding: their state forgotten): the head is included and every signature verifies,
    but the checkpoint does not extend the window before's."""
    entries, objs = deployed.entries(), _windows(honest)
    i, prev = objs[2]["operator"]["index"], Checkpoint.parse(parse_note(objs[1]["operator"]["checkpoint"].encode())
                                                                 .text).size
    assert prev <= i
    fork = MerkleTree([entry_leaf(b'{"fork":0}')] + [entry_leaf(e) for e in entries[1:i + 1]])
    note = _op_note(fork, deployed.op_key)
    sigs = list(note.signatures)
    for w in deployed.witnesses:  # the same keys, their state forgotten: a cosignature of the fork from size 0
        status, line, _ = SpecWitness(w.name, w.logs, key=w.key).add_checkpoint(b"old 0\n\n" + note.encode())
        assert status == 200
        sigs += parse_note(note.encode() + line).signatures[1:]

    def inconsistent(objs: list[dict]) -> None:
        objs[2]["operator"] = {"checkpoint": Note(note.text, tuple(sigs)).encode().decode(), "index": i,
                               "inclusion": [h.hex() for h in fork.inclusion_proof(i, fork.size)],
                               "consistency": [h.hex() for h in fork.consistency_proof(prev, fork.size)]}

    code, v = deployed.verify(_rewrite(honest, tmp_path / "a", inconsistent), capsys)
    assert code == 1 and any(f"does not extend the log of size {prev}" in f for f in v["failures"]), v["failures"]


def test_a_backdated_cosignature_does_not_make_a_window_count(tmp_path, monkeypatch, capsys):
    """A colluding witness backdates its cosignatures so that rounds the trainer could know look drawn after
    them; the honest witness's come too late. With both witnesses required (the default) no window counts;
    only a verifier requiring one of them takes the colluding witness's word. And a cosignature whose
    timestamp is changed afterwards no longer verifies."""
    (tmp_path / "d").mkdir()
    d = Deployment(tmp_path / "d", backdate=(100, 0))
    monkeypatch.setattr(OperatorLink, "next_round", _early)
    try:
        out = d.train(tmp_path / "run", seed="43")
        objs = _windows(out)
        for w in objs:
            note, due = parse_note(w["operator"]["checkpoint"].encode()), round_time(d.drand.chain, w["round"])
            times = [int.from_bytes(s.sig[:8], "big") for s in note.signatures[1:]]
            assert times[0] + 1 < due <= times[1] + 1, (times, due)  # w1 backdated, w2 late
        code, v = d.verify(out, capsys)
        assert v["accepted"] and v["online"]["selected"] == [] and v["online"]["unaudited"] == STEPS, v["online"]
        assert v["detection_probability"] == 0.0
        assert any("cosigned within a drand period of its round" in n for n in v["notes"])
        code, v = d.verify(out, capsys, "--witnesses-required", "1")
        assert code == 0 and v["online"]["unaudited"] == 0, v["online"]

        def retimed(objs: list[dict]) -> None:  # w2's cosignature, its time moved 100 s earlier
            note = parse_note(objs[1]["operator"]["checkpoint"].encode())
            s = note.signatures[2]
            t = int.from_bytes(s.sig[:8], "big") - 100
            sigs = (*note.signatures[:2], NoteSignature(s.name, s.key_id, t.to_bytes(8, "big") + s.sig[8:]))
            objs[1]["operator"]["checkpoint"] = Note(note.text, sigs).encode().decode()

        code, v = d.verify(_rewrite(out, tmp_path / "a", retimed), capsys)
        assert code == 1 and any("w2.example does not verify" in f for f in v["failures"]), v["failures"]
    finally:
        d.close()


def test_a_round_the_trainer_could_know_does_not_count_through_the_operator(deployed, tmp_path, monkeypatch,
                                                                             capsys):
    """A trainer that names the next round, due within a drand period of the witnesses' cosignatures, could
    know its draw before they held the checkpoint: through the operator's log too, its windows select nothing."""
    monkeypatch.setattr(OperatorLink, "next_round", _early)
    out = deployed.train(tmp_path / "early", seed="42")
    for w in _windows(out):
        note, due = parse_note(w["operator"]["checkpoint"].encode()), round_time(deployed.drand.chain, w["round"])
        assert all(int.from_bytes(s.sig[:8], "big") + 1 >= due for s in note.signatures[1:])
    code, v = deployed.verify(out, capsys)
    assert code == 0 and v["accepted"], v
    assert v["online"]["selected"] == [] and v["online"]["unaudited"] == STEPS and v["detection_probability"] == 0.0
    assert v["moves"]["checked"] == 0 and v["moves"]["late"] == STEPS
    assert any("cosigned within a drand period of its round" in n for n in v["notes"])
