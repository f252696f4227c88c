"""Online challenges that trust no single server, end to end on loopback: two witnesses (the
beacon's server, speaking C2SP tlog-witness) cosign each window's checkpoint, a local
drand-compatible endpoint (its own BLS key, pinned here, never presented as quicknet) gives each
window's randomness, ``witness train --witness … --drand …`` records, and ``witness verify --mode
online --witness NAME=KEY … --drand CHAIN-INFO`` checks. Each attack is a bundle a dishonest
trainer can make: a fork through one colluding witness, a round it could already know, a round
of another chain, a cosignature left out, a window withheld or moved, two heads raced."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch

from witness.beacon.app import create_app
from witness.beacon.drand import DrandClient, LocalDrand
from witness.beacon.drand import create_app as drand_app
from witness.beacon.windows import WitnessedLink
from witness.beacon.witness_client import WitnessClient
from witness.bundle.layout import STATEMENTS
from witness.cli import main
from witness.commit.beacon import run_id
from witness.commit.cosignature import cosign
from witness.commit.drand import round_after, round_time
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.note import Checkpoint, Note, parse_note, run_origin, sign_note
from witness.commit.signing import generate_key, save_key
from witness.commit.window import WitnessedWindow
from witness.record import Commitments, Online, SelfChecking, Training
from witness.record.online import OnlineSpec
from witness.record.recorder import Recorder
from witness.task import build_task
from witness.web import start_uvicorn, stop_uvicorn

STEPS, P, EVERY = 24, 0.25, 4
SEED = b"\x31" * 32  # the local chain's BLS key, fixed: its chain info is pinned by the test


class Loopback:
    """A local drand chain and ``witnesses`` witnesses (two by default), served on loopback for one module."""

    def __init__(self, folder: Path, witnesses: int = 2, pq: tuple[int, ...] = (), wrap=None):  # noqa: ANN001
        """``pq``: the witnesses started with an ML-DSA-44 cosigner key (``--cosigner ml-dsa-44``);
        ``wrap``: ASGI middleware around each witness."""
        from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

        self.folder = folder
        self.drand = LocalDrand(seed=SEED, period=1)
        self.info = folder / "chain-info.json"
        self.info.write_text(json.dumps(self.drand.chain.to_json()))
        self.servers = [start_uvicorn(drand_app(self.drand))]
        self.keys = [generate_key() for _ in range(witnesses)]
        self.names = [f"w{i + 1}.example" for i in range(witnesses)]
        for i, k in enumerate(self.keys):
            app = create_app(f"sqlite:///{folder / f'w{i}.db'}", k, name=self.names[i],
                             cosigner_key=MLDSA44PrivateKey.generate() if i in pq else None)
            self.servers.append(start_uvicorn(app if wrap is None else wrap(app)))
        self.drand_url = self.servers[0][2]
        self.urls = [s[2] for s in self.servers[1:]]
        self.clients = [WitnessClient(u) for u in self.urls]
        self.vkeys = [c.key.vkey() for c in self.clients]

    def witness_args(self, which: tuple[int, ...] = (0, 1)) -> list[str]:
        """``--witness NAME=KEY`` for the verifier (its keys as hex)."""
        out = []
        for i in which:  # (an ML-DSA-44 witness's key is given as its vkey)
            key = self.clients[i].key
            out += ["--witness", key.vkey() if len(key.public) > 32 else f"{self.names[i]}={key.public.hex()}"]
        return out

    def close(self) -> None:
        for server, thread, _ in self.servers:
            stop_uvicorn(server, thread)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    lb = Loopback(tmp_path_factory.mktemp("loopback"))
    yield lb
    lb.close()


@pytest.fixture(scope="module")
def honest(loop, tmp_path_factory):
    """An honest run trained through the command line, both witnesses cosigning."""
    return _train_cli(loop, tmp_path_factory.mktemp("honest"))


def _train_cli(loop: Loopback, folder: Path) -> Path:
    """A run trained through the command line, every witness of ``loop`` cosigning; its bundle."""
    key = folder / "trainer.key"
    save_key(generate_key(), key)
    args = ["train", "--task", "tiny", "--steps", str(STEPS), "--out", str(folder / "b"), "--key", str(key),
            "--quiet", "--no-self-check", "--online-p", str(P), "--online-every", str(EVERY), "--drand",
            loop.drand_url, "--drand-chain", str(loop.info)]
    for u in loop.urls:
        args += ["--witness", u]
    assert main(args) == 0
    return folder / "b"


def verify(bundle: Path, loop: Loopback, *extra: str, which: tuple[int, ...] = (0, 1), capsys=None) -> tuple[int, dict]:
    """``witness verify --mode online`` naming the witnesses in ``which``; its exit code and JSON."""
    code = main(["verify", "--allow-weak", str(bundle), "--mode", "online", *loop.witness_args(which),
                 "--drand", str(loop.info), "--bad-fraction", "0.5", "--json", *extra])
    out = capsys.readouterr().out if capsys is not None else "{}"
    return code, json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


def copy(bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    return out


def windows(bundle: Path) -> list[dict]:
    return [parse_canonical_json(line) for line in (bundle / STATEMENTS).read_bytes().splitlines()]


def write_windows(bundle: Path, objs: list[dict]) -> None:
    (bundle / STATEMENTS).write_bytes(b"".join(canonical_json(o) + b"\n" for o in objs))


def test_honest_run_is_accepted_with_both_witnesses(honest, loop, capsys):
    code, v = verify(honest, loop, capsys=capsys)
    assert code == 0, v
    assert v["accepted"]
    online = v["online"]
    assert online["witnessed"] and "w1.example" in online["witnessed"] and "w2.example" in online["witnessed"]
    assert online["windows"] == len(windows(honest)) >= STEPS // EVERY
    assert online["unaudited"] == 0 and online["final"] and online["attempts"] == 0
    # every selected step replayed; the selection is the one beta gives (checked against the windows)
    from witness.commit.beacon import selected_steps

    sts = [WitnessedWindow.from_json(o) for o in windows(honest)]
    assert online["selected"] == sorted(t for st in sts for t in selected_steps(st, P, STEPS))
    assert v["detection_probability"] > 0
    # every step's move checked too, at the chunks drand's randomness opened
    assert v["moves"]["checked"] == STEPS and v["moves"]["late"] == 0 \
        and v["moves"]["windows"] == sum(1 for st in sts if len(st.window(STEPS)))  # (the final one opens no step)


def test_a_run_cosigned_by_an_ml_dsa_44_witness_beside_an_ed25519_one_is_accepted(tmp_path_factory, capsys):
    """tlog-cosignature's ML-DSA-44 type beside cosignature/v1: the trainer takes either witness's
    cosignatures, the verifier pinned to each one's vkey checks both and both witnesses' attempts counts."""
    pq = Loopback(tmp_path_factory.mktemp("pq"), pq=(1,))
    try:
        assert [len(c.key.public) for c in pq.clients] == [32, 1312]
        bundle = _train_cli(pq, tmp_path_factory.mktemp("pq-run"))
        code, v = verify(bundle, pq, capsys=capsys)
        assert code == 0 and v["accepted"], v
        assert v["online"]["witnessed"] and v["online"]["attempts"] == 0 and v["online"]["final"]
        sigs = parse_note(windows(bundle)[0]["checkpoint"].encode()).of_key(pq.clients[1].key)
        assert len(sigs) == 1 and len(sigs[0].sig) == 8 + 2420
    finally:
        pq.close()


def test_each_window_names_its_round_in_the_log_and_was_cosigned_before_it(honest, loop):
    lines = (honest / "log.jsonl").read_bytes().splitlines()
    for o in windows(honest):
        w = WitnessedWindow.from_json(o)
        assert parse_canonical_json(lines[w.size - 1])["round"] == w.round  # the root binds the round
        note = parse_note(w.checkpoint)
        times = [int.from_bytes(s.sig[:8], "big") for s in note.signatures if len(s.sig) == 72]
        assert len(times) == 2 and max(times) + loop.drand.chain.period < round_time(loop.drand.chain, w.round)


def test_one_witness_required_of_two_accepts_and_the_verdict_says_so(honest, loop, capsys):
    code, v = verify(honest, loop, "--witnesses-required", "1", capsys=capsys)
    assert code == 0 and "1 of the witness(es)" in v["online"]["witnessed"]


def test_a_fork_through_one_colluding_witness_is_refused_with_two_required(honest, loop, tmp_path, capsys):
    """The trainer trains the same run again with a bad step, and has witness 1 (colluding: its
    database forgotten) cosign the fork. Witness 2 holds the honest checkpoints and refuses it."""
    colluding = start_uvicorn(create_app(f"sqlite:///{tmp_path / 'forgot.db'}", loop.keys[0], name=loop.names[0]))
    try:
        link = WitnessedLink([WitnessClient(colluding[2])], DrandClient(loop.drand_url, loop.drand.chain))
        fork = _train_fork(tmp_path / "fork", link, _trainer_key(honest), honest)
    finally:
        stop_uvicorn(colluding[0], colluding[1])
    # the honest witness refuses the fork's first window: it holds the run's final checkpoint
    w = WitnessedWindow.from_json(windows(fork)[0])
    resp = httpx.post(f"{loop.urls[1]}/api/beacon/add-checkpoint",
                      content=b"old 0\n\n" + w.checkpoint, timeout=10)
    assert resp.status_code == 409 and resp.headers["content-type"].startswith("text/x.tlog.size")
    code, v = verify(fork, loop, capsys=capsys)
    assert code == 1 and not v["accepted"]
    assert any("cosigned by 1 of the 2" in f for f in v["failures"]), v["failures"]
    # a verifier that trusts the colluding witness alone takes its windows (then only replay of the
    # bad step, if its draw selects it, catches the fork)
    code, v = verify(fork, loop, which=(0,), capsys=capsys)
    assert not any("cosign" in f or "witness" in f for f in v.get("failures", [])), v["failures"]
    assert code == 0 or any("step 6" in f for f in v["failures"]), v["failures"]


def test_a_round_the_trainer_could_know_does_not_count(loop, tmp_path, capsys):
    """A trainer that names a round already drawn (or one within a period of the cosignatures) knew
    its draw before the witnesses held the checkpoint: those windows select nothing."""

    class Early(WitnessedLink):
        def next_round(self) -> int:
            return round_after(self.chain, __import__("time").time() - 5)

    link = Early([WitnessClient(u) for u in loop.urls], DrandClient(loop.drand_url, loop.drand.chain))
    out = _train(tmp_path / "early", link)
    code, v = verify(out, loop, capsys=capsys)
    assert v["accepted"] and v["online"]["selected"] == [] and v["online"]["unaudited"] == STEPS
    assert v["detection_probability"] == 0.0
    # their chunks are opened and checked all the same, but no step counts as checked
    assert v["moves"]["checked"] == 0 and v["moves"]["late"] == STEPS
    assert any("cosigned within a drand period of its round" in n for n in v["notes"])


def test_a_round_of_another_chain_is_refused(honest, loop, tmp_path, capsys):
    other = LocalDrand(seed=b"\x32" * 32, period=1, genesis_time=loop.drand.chain.genesis_time)
    out = copy(honest, tmp_path)
    objs = windows(out)
    objs[1]["drand_signature"] = other.sign(objs[1]["round"]).hex()
    write_windows(out, objs)
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("round" in f and "drand" in f.lower() for f in v["failures"]), v["failures"]


def test_a_window_whose_round_differs_from_the_log_is_refused(honest, loop, tmp_path, capsys):
    out = copy(honest, tmp_path)
    objs = windows(out)
    objs[0]["round"] -= 1
    objs[0]["drand_signature"] = loop.drand.sign(objs[0]["round"]).hex()  # a valid round, not the log's
    write_windows(out, objs)
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("names drand round" in f for f in v["failures"]), v["failures"]


def test_a_missing_cosignature_is_refused(honest, loop, tmp_path, capsys):
    out = copy(honest, tmp_path)
    objs = windows(out)
    note = parse_note(objs[2]["checkpoint"].encode())
    kept = tuple(s for s in note.signatures if s.name != loop.names[1])
    objs[2]["checkpoint"] = Note(note.text, kept).encode().decode()
    write_windows(out, objs)
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("cosigned by 1 of the 2" in f for f in v["failures"]), v["failures"]


def test_a_cosignature_of_another_checkpoint_is_refused(honest, loop, tmp_path, capsys):
    """Witness 2's line from window 1 pasted into window 2: a named witness's line that does not verify."""
    out = copy(honest, tmp_path)
    objs = windows(out)
    a, b = parse_note(objs[0]["checkpoint"].encode()), parse_note(objs[1]["checkpoint"].encode())
    stolen = next(s for s in a.signatures if s.name == loop.names[1])
    objs[1]["checkpoint"] = Note(b.text, tuple(s for s in b.signatures if s.name != loop.names[1]) + (stolen,)) \
        .encode().decode()
    write_windows(out, objs)
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("does not verify" in f for f in v["failures"]), v["failures"]


def test_a_withheld_or_duplicated_window_is_refused_and_order_does_not_matter(honest, loop, tmp_path, capsys):
    out = copy(honest, tmp_path)
    objs = windows(out)
    write_windows(out, objs[:2] + objs[3:])
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("withheld" in f for f in v["failures"]), v["failures"]
    write_windows(out, objs + [objs[1]])
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("two witnessed windows" in f for f in v["failures"]), v["failures"]
    write_windows(out, objs[::-1])
    code, v = verify(out, loop, capsys=capsys)
    assert code == 0 and v["accepted"]
    # the last windows dropped: their steps are not audited, and the bound is 0 with no final count
    write_windows(out, objs[:3])
    code, v = verify(out, loop, capsys=capsys)
    assert v["accepted"] and v["online"]["unaudited"] > 0 and v["detection_probability"] == 0.0


def test_a_window_at_a_boundary_of_the_trainers_choosing_is_refused(honest, loop, tmp_path, capsys):
    """A checkpoint at a size the manifest sets no head at (to draw that window again), cosigned by
    both witnesses' keys: refused for where it lies, whatever signed it."""
    out = copy(honest, tmp_path)
    objs = windows(out)
    lines = (out / "log.jsonl").read_bytes().splitlines()
    from witness.commit.log import RunLog

    size = objs[0]["size"] + 1
    origin = run_origin(run_id(lines[0]))
    text = Checkpoint(origin, size, RunLog(lines[:size]).root()).text()
    sigs = [sign_note(text, origin, _trainer_key(honest))]
    for i, k in enumerate(loop.keys):
        sigs.append(cosign(text, loop.names[i], k, int(__import__("time").time()) - 100))
    objs[1] = dict(objs[1], size=size, prev_size=objs[0]["size"], checkpoint=Note(text, tuple(sigs)).encode().decode())
    write_windows(out, objs)
    code, v = verify(out, loop, capsys=capsys)
    assert code == 1 and any("not a boundary" in f for f in v["failures"]), v["failures"]


def test_trust_is_the_verifiers_choice(honest, loop, tmp_path, capsys):
    """A beacon's key does not verify witnessed windows, a witness named twice is not two, and a
    bundle's windows under other keys prove nothing."""
    code = main(["verify", str(honest), "--mode", "online", "--beacon-key", loop.clients[0].key.public.hex()])
    assert code == 1
    capsys.readouterr()
    dup = ["--witness", f"{loop.names[0]}={loop.clients[0].key.public.hex()}",
           "--witness", f"other.example={loop.clients[0].key.public.hex()}"]
    assert main(["verify", str(honest), "--mode", "online", *dup, "--drand", str(loop.info)]) == 2
    strangers = ["--witness", f"{loop.names[0]}={generate_key().public_key().public_bytes_raw().hex()}",
                 "--witness", f"{loop.names[1]}={generate_key().public_key().public_bytes_raw().hex()}"]
    assert main(["verify", str(honest), "--mode", "online", *strangers, "--drand", str(loop.info)]) == 1
    assert main(["verify", str(honest), "--mode", "online", *loop.witness_args(), "--drand", "quicknet"]) == 1
    err = capsys.readouterr().err
    assert "quicknet" in err


def test_racing_heads_get_one_cosignature(loop):
    """Two checkpoints of one run sent at once from the same old size: exactly one is cosigned."""
    key = generate_key()
    manifest = canonical_json({"type": "manifest", "public_key": key.public_key().public_bytes_raw().hex(),
                               "run_seed": "00" * 32, "task": "tiny", "task_config": {}, "data_root": "00" * 32,
                               "dataset_size": 1, "steps_planned": 1})
    from witness.commit.log import RunLog

    log = RunLog([manifest])
    for i in range(6):
        log.append({"type": "step", "step": i})
    client = loop.clients[1]
    client.register(manifest)
    origin = run_origin(run_id(manifest))
    notes = []
    for size in (4, 6):
        text = Checkpoint(origin, size, log.root(size)).text()
        notes.append(Note(text, (sign_note(text, origin, key),)).encode())
    codes: list[int] = []

    def send(note: bytes) -> None:
        r = httpx.post(f"{loop.urls[1]}/api/beacon/add-checkpoint", content=b"old 0\n\n" + note, timeout=30)
        codes.append(r.status_code)

    threads = [threading.Thread(target=send, args=(n,)) for n in notes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 409], codes


# --- helpers -------------------------------------------------------------------------------


def _trainer_key(bundle: Path):
    from witness.commit.signing import load_key

    return load_key(bundle.parent / "trainer.key")


def _train(out: Path, link, key=None, *, bad: set[int] = frozenset(), like: Path | None = None,
           r: bytes = b"\x05" * 32) -> Path:
    """A tiny online run through ``link``; at each step in ``bad`` the weights are nudged before it is
    trained. ``like``: the same manifest as that bundle's (its key, r and settings: its very origin)."""
    task = build_task("tiny", {"steps": STEPS})
    if like is not None:
        m = parse_canonical_json((like / "log.jsonl").read_bytes().splitlines()[0])
        kw = {"r": bytes.fromhex(m["r"]), "commit": Commitments(checkpoint_every=m["checkpoint_every"]),
              "training": Training(threads=m["threads"])}
        spec = OnlineSpec(**m["online"])
    else:
        kw, spec = {"r": r}, OnlineSpec(p=P, every=EVERY, ring=64)
    rec = Recorder.create(task, out, key or generate_key(), online=Online(beacon=link, spec=spec),
                          self_check=SelfChecking(enabled=False), **kw)
    for t in range(STEPS):
        if t in bad:
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(0.01)
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    rec.finish()
    if like is not None:  # a fork: the same run (origin), another history
        assert (out / "log.jsonl").read_bytes().splitlines()[0] == (like / "log.jsonl").read_bytes().splitlines()[0]
    return out


def _train_fork(out: Path, link, key, honest: Path) -> Path:
    """The honest run again (its manifest, so its origin) with step 6 trained on a nudged state."""
    return _train(out, link, key, bad={6}, like=honest)


@pytest.mark.parametrize("kill_at", ["training", "end"])
def test_a_witnessed_run_killed_and_resumed_verifies(loop, tmp_path, capsys, kill_at):
    """kill -9 while windows wait for their rounds (cosigned, not yet settled), mid-run or once the
    end record is written, then --resume: the cosigned checkpoints are not lost, the witnesses
    (which keep only the latest) are not asked for what they no longer hold, the lost selected
    states are rebuilt, and the run verifies with both witnesses."""
    import os
    import signal
    import subprocess
    import sys
    import time

    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", "60", "--checkpoint-every", "20",
           "--seed", "witnessed", "--key", str(key), "--out", str(out), "--quiet", "--no-self-check", "--online-p",
           "0.2", "--online-every", "4", "--drand", loop.drand_url, "--drand-chain", str(loop.info)]
    for u in loop.urls:
        cmd += ["--witness", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    lines_wanted = 2 if kill_at == "training" else 60 + 2  # two windows kept, or the end record written
    while time.time() < deadline:
        st, log = out / STATEMENTS, out / "log.jsonl"
        if kill_at == "training" and st.exists() and st.read_bytes().count(b"\n") >= lines_wanted:
            break
        if kill_at == "end" and log.exists() and log.read_bytes().count(b"\n") >= lines_wanted:
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert kill_at == "training" or (out / "online" / "cosigned.jsonl").exists()  # windows not all settled
    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not (out / "online" / "cosigned.jsonl").exists()
    code, v = verify(out, loop, capsys=capsys)
    assert code == 0 and v["accepted"] and v["complete"] and v["online"]["final"], v


class FinalOutage:
    """ASGI middleware around a witness: down (503) for the run's final checkpoint while ``down``."""

    def __init__(self, app, final: int):  # noqa: ANN001
        self.app, self.final, self.down, self.refused = app, final, True, 0

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or not scope["path"].endswith("add-checkpoint"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        if self.down and f"\n{self.final}\n".encode() in body:  # the checkpoint's size line
            self.refused += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"4")]})
            return await send({"type": "http.response.body", "body": b"down"})
        sent = False

        async def again():  # noqa: ANN202
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, again, send)


def test_a_witness_outage_at_the_run_end_is_settled_by_resume(tmp_path, capsys):
    """The witnesses are down for longer than the patience when the run's final checkpoint goes out:
    training completes and exits 2 naming --resume; --resume (the witnesses back) posts the final
    checkpoint and settles its window, which comes too late for the round its end record named and so
    counts for nothing: the verdict says so and claims only the windows before it."""
    outages: list[FinalOutage] = []
    (tmp_path / "lb").mkdir()
    lb = Loopback(tmp_path / "lb", wrap=lambda app: outages.append(FinalOutage(app, STEPS + 2)) or outages[-1])
    try:
        key = tmp_path / "trainer.key"
        save_key(generate_key(), key)
        args = ["train", "--task", "tiny", "--steps", str(STEPS), "--out", str(tmp_path / "b"), "--key", str(key),
                "--quiet", "--no-self-check", "--online-p", str(P), "--online-every", str(EVERY), "--drand",
                lb.drand_url, "--drand-chain", str(lb.info), "--beacon-patience", "2"]
        for u in lb.urls:
            args += ["--witness", u]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "--resume" in err and "Traceback" not in err, err
        assert outages[0].refused
        for o in outages:
            o.down = False
        assert main([*args, "--resume"]) == 0, capsys.readouterr().err
        capsys.readouterr()
        code, v = verify(tmp_path / "b", lb, capsys=capsys)
        assert code == 0 and v["accepted"] and v["complete"], v
        assert "cosigned too" in json.dumps(v), v  # the late final window is named, and claims nothing
    finally:
        lb.close()


def test_inspect_shows_a_witnessed_runs_windows(honest, capsys):
    assert main(["inspect", str(honest)]) == 0
    out = capsys.readouterr().out
    assert "witnessed window(s)" in out and "--witness NAME=KEY" in out
    assert main(["inspect", str(honest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["online"]["witnessed"] and info["online"]["statements"] == len(windows(honest))
