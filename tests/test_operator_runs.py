"""Runs witnessed through an operator's log, end to end through the commands: ``witness train --operator
URL --drand URL`` and ``witness verify --operator VKEY --operator-url URL``. An honest run is accepted;
a restart under the run's seed is read from the log and priced; and a window that did not come through
the pinned log, or whose proof does not hold, is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from witness.beacon.app import create_app as witness_app
from witness.beacon.drand import LocalDrand
from witness.beacon.drand import create_app as drand_app
from witness.beacon.operator import OperatorLog
from witness.beacon.operator_app import create_app as operator_app
from witness.beacon.operator_db import create_tables
from witness.beacon.witness_client import WitnessClient
from witness.bundle.layout import STATEMENTS
from witness.cli import main
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.note import Checkpoint, Note, NoteKey, sign_note
from witness.commit.signing import generate_key, save_key
from witness.database import make_engine, sessions
from witness.web import start_uvicorn, stop_uvicorn

STEPS, P, EVERY = 16, 0.25, 4
ORIGIN = "operator.example/runs"


class Deployment:
    """A local drand chain, two witnesses configured for the operator's log, and the log, on loopback."""

    def __init__(self, folder: Path):
        self.drand = LocalDrand(seed=b"\x32" * 32, period=1)
        self.info = folder / "chain-info.json"
        self.info.write_text(json.dumps(self.drand.chain.to_json()))
        self.op_key = generate_key()
        self.vkey = NoteKey.of(ORIGIN, self.op_key.public_key())
        self.servers = [start_uvicorn(drand_app(self.drand))]
        for i in (1, 2):
            self.servers.append(start_uvicorn(witness_app(f"sqlite:///{folder / f'w{i}.db'}", generate_key(),
                                                          name=f"w{i}.example", known=(self.vkey,))))
        self.clients = [WitnessClient(s[2]) for s in self.servers[1:]]  # (the test asks their keys)
        engine = make_engine(f"sqlite:///{folder / 'op.db'}")
        create_tables(engine)
        pinned = [WitnessClient(s[2], vkey=c.key.vkey(), ask_key=False) for s, c in zip(self.servers[1:], self.clients,
                                                                                         strict=True)]
        self.log = OperatorLog(sessions(engine), self.op_key, ORIGIN, pinned)
        self.servers.append(start_uvicorn(operator_app(self.log)))
        self.drand_url, self.operator_url = self.servers[0][2], self.servers[-1][2]

    def train(self, out: Path, seed: str = "7", key: Path | None = None, steps: int = STEPS) -> None:
        if key is None:
            key = out.parent / f"{out.name}.key"
            save_key(generate_key(), key)
        assert main(["train", "--task", "tiny", "--steps", str(steps), "--out", str(out), "--key", str(key), "--quiet",
                     "--no-self-check", "--online-p", str(P), "--online-every", str(EVERY), "--drand", self.drand_url,
                     "--drand-chain", str(self.info), "--operator", self.operator_url, "--seed", seed]) == 0

    def verify(self, bundle: Path, capsys, *extra: str, url: bool = True) -> tuple[int, dict]:
        args = ["verify", "--allow-weak", str(bundle), "--mode", "online", "--drand", str(self.info), "--bad-fraction",
                "0.5", "--json", "--operator", self.vkey.vkey(), *extra]
        args += ["--operator-url", self.operator_url] if url else []
        for c in self.clients:
            args += ["--witness", f"{c.key.name}={c.key.public.hex()}"]
        code = main(args)
        out = capsys.readouterr().out.strip()
        return code, json.loads(out.splitlines()[-1]) if out else {}

    def close(self) -> None:
        for server, thread, _ in self.servers:
            stop_uvicorn(server, thread)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("operator"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def honest(deployed, tmp_path_factory):
    out = tmp_path_factory.mktemp("honest") / "b"
    deployed.train(out, seed="41")
    return out


def _windows(bundle: Path) -> list[dict]:
    return [parse_canonical_json(line) for line in (bundle / STATEMENTS).read_bytes().splitlines()]


def _rewrite(bundle: Path, tmp_path: Path, change) -> Path:  # noqa: ANN001
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    objs = _windows(out)
    change(objs)
    (out / STATEMENTS).write_bytes(b"".join(canonical_json(o) + b"\n" for o in objs))
    return out


def test_an_honest_run_through_the_operator_log_is_accepted_and_its_attempts_read_from_the_log(deployed, honest,
                                                                                             capsys):
    windows = _windows(honest)
    assert windows and all("operator" in w for w in windows)
    code, v = deployed.verify(honest, capsys)
    assert code == 0 and v["accepted"], v
    online = v["online"]
    assert online["final"] and online["attempts"] == 0 and online["unaudited"] == 0
    assert "through the operator log operator.example/runs" in online["witnessed"]
    # without the entries the attempts are unknown, and the verdict says so rather than claiming 0
    code, v = deployed.verify(honest, capsys, url=False)
    assert v["online"]["attempts"] is None


def test_a_restart_under_the_runs_seed_is_read_from_the_log_and_priced(deployed, honest, tmp_path, capsys):
    again = tmp_path / "again"
    # the same key and seed text (the same run seed, over the same data), another recipe: another run of its seed
    deployed.train(again, seed="41", key=honest.parent / "b.key", steps=STEPS + EVERY)
    code, v = deployed.verify(again, capsys)
    assert code == 0 and v["online"]["attempts"] == 1, v["online"]
    code, v = deployed.verify(honest, capsys)  # the first run's windows ended before it: the log held it alone then
    assert v["online"]["attempts"] == 0


def test_windows_that_did_not_come_through_the_pinned_log_are_refused(deployed, honest, tmp_path, capsys):
    def drop(objs: list[dict]) -> None:  # a window without its operator proof
        del objs[1]["operator"]

    code, v = deployed.verify(_rewrite(honest, tmp_path / "a", drop), capsys)
    assert code == 1 and "did not come through the pinned operator log" in json.dumps(v)

    def moved(objs: list[dict]) -> None:  # another entry's place: the inclusion proof does not hold
        objs[1]["operator"]["index"] += 1

    code, v = deployed.verify(_rewrite(honest, tmp_path / "b", moved), capsys)
    assert code == 1 and "is not entry" in json.dumps(v)

    other = generate_key()  # an operator checkpoint the trainer signed itself, with the log's origin

    def forged(objs: list[dict]) -> None:
        note = objs[1]["operator"]["checkpoint"]
        text = note.split("\n\n")[0] + "\n"
        objs[1]["operator"]["checkpoint"] = Note(text, (sign_note(text, ORIGIN, other),)).encode().decode()

    code, v = deployed.verify(_rewrite(honest, tmp_path / "c", forged), capsys)
    assert code == 1 and "not the pinned log" in json.dumps(v)

    def inconsistent(objs: list[dict]) -> None:  # the consistency proof between two windows' checkpoints
        objs[2]["operator"]["consistency"] = [("00" * 32)] * max(1, len(objs[2]["operator"]["consistency"]))

    code, v = deployed.verify(_rewrite(honest, tmp_path / "d", inconsistent), capsys)
    assert code == 1
    # a verifier that pins no operator log refuses windows that came through one
    args = ["verify", "--allow-weak", str(honest), "--mode", "online", "--drand", str(deployed.info), "--json"]
    for c in deployed.clients:
        args += ["--witness", f"{c.key.name}={c.key.public.hex()}"]
    assert main(args) == 1 and "verifier pins none" in capsys.readouterr().out


def test_a_second_version_of_the_run_entered_by_a_dishonest_operator_is_found_in_the_log(tmp_path, capsys):
    """The operator's witnesses see its log, not each run's: an operator that is the trainer could enter a
    second version of the run's head beside the first, in time for a second draw. Reading the entries up
    to the final window's checkpoint, the verifier finds any head of the run that is not the bundle's log.
    (A second version of the last head entered after the last window's checkpoint cannot be presented: any
    operator checkpoint that holds it holds the first version too.)"""
    import os

    from witness.commit.operator import head_entry
    from witness.commit.signing import load_key

    (tmp_path / "d").mkdir()
    d = Deployment(tmp_path / "d")
    key = tmp_path / "run.key"
    save_key(generate_key(), key)
    real = d.log.add_head

    def forking(run: str, note: bytes, old: int, proof: list[bytes]) -> int:
        index = real(run, note, old, proof)
        cp = Checkpoint.parse(note.decode().split("\n\n")[0] + "\n")
        if old == 0:  # beside the run's first head, another version of it, signed by the run's key
            text = Checkpoint(cp.origin, cp.size, os.urandom(32)).text()
            other = Note(text, (sign_note(text, cp.origin, load_key(key)),)).encode()
            with d.log._append, d.log.sessions() as s:
                d.log._add(s, head_entry(bytes.fromhex(run), other).entry(), "head", run, None, cp.size)
        return index

    d.log.add_head = forking
    try:
        d.train(tmp_path / "run", seed="77", key=key)
        code, v = d.verify(tmp_path / "run", capsys)
        assert code == 1 and "another version of the run" in json.dumps(v)
    finally:
        d.close()


@pytest.mark.parametrize("kill_at", ["training", "end"])
def test_a_run_through_the_operator_killed_and_resumed_verifies(deployed, tmp_path, capsys, kill_at):
    """kill -9 while windows wait for their rounds (their operator checkpoints cosigned, not yet settled),
    mid-run or once the end record is written, then --resume: the journaled windows keep their operator
    proofs, heads the operator took but the run did not keep are taken again, and the run verifies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    key = tmp_path / "key.pem"
    save_key(generate_key(), key)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", "60", "--checkpoint-every", "20",
           "--seed", f"operator-{kill_at}", "--key", str(key), "--out", str(out), "--quiet", "--no-self-check",
           "--online-p", "0.2", "--online-every", "4", "--drand", deployed.drand_url, "--drand-chain",
           str(deployed.info), "--operator", deployed.operator_url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        st, log = out / STATEMENTS, out / "log.jsonl"
        if kill_at == "training" and st.exists() and st.read_bytes().count(b"\n") >= 2:
            break
        if kill_at == "end" and log.exists() and log.read_bytes().count(b"\n") >= 62:
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not (out / "online" / "cosigned.jsonl").exists()
    code, v = deployed.verify(out, capsys)
    assert code == 0 and v["accepted"] and v["complete"] and v["online"]["final"], v
