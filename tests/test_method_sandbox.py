"""A submitted method's run, verified with its steps replayed only in the sandbox (``witness.methods``):
an honest one is accepted by a process that never imports it, and a method that tries to escape, hang,
exhaust the machine or lie about its outputs is rejected, with the verifying process going on."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from methods_helpers import ALL, method_source, train, wheel_bytes

from witness import sandbox
from witness.cli import main
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.methods import process
from witness.methods.wheel import read_wheel
from witness.task import build_task
from witness.verify.audit import Verifier
from witness.verify.policy import Evidence, Policy, Trust

pytestmark = pytest.mark.skipif(sandbox.shutil.which("bwrap") is None, reason="unreachable: services.sh installs bwrap")


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    """Limits a test can wait out: a step answered within 5 s, 3 GiB of address space, a 64 MiB scratch."""
    monkeypatch.setattr(process, "LIMITS", sandbox.Limits(cpu_seconds=120, memory_bytes=3 << 30, file_bytes=16 << 20,
                                                         processes=32, wall_seconds=120, output_bytes=16 << 10))
    monkeypatch.setattr(process, "STEP_SECONDS", 5.0)
    monkeypatch.setattr(process, "SCRATCH_BYTES", 64 << 20)


def verify(wheel: bytes, run: tuple[Path, Path]):
    """The interactive audit of every step, the method given by the verifier."""
    verifier = Verifier(Trust(method=read_wheel(wheel)), Policy(challenges=ALL, nonce=b"r", mode="interactive"))
    return verifier.verify(run[0], Evidence(response=run[1]))


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """An honest method's wheel, and a run trained with it."""
    wheel = wheel_bytes(method_source())
    return wheel, train(wheel, tmp_path_factory.mktemp("honest"))


def _cgroups() -> set[str]:
    found = set()
    for root in sandbox.PIDS_ROOTS:
        if root.exists():
            found |= {p.name for p in root.glob("witness-sandbox-*")}
    return found


def test_an_honest_method_is_replayed_in_the_sandbox_and_accepted(honest):
    wheel, run = honest
    v = verify(wheel, run)
    assert v.accepted and v.replayed_steps == 6, v.failures
    assert any("ran only in the sandbox" in c and read_wheel(wheel).sha256[:16] in c for c in v.checks), v.checks
    import sys
    assert "sandboxed_mlp" not in sys.modules  # the verifying process never imported the method


def test_witness_verify_method_replays_in_the_sandbox(honest, tmp_path, capsys):
    wheel, (bundle, response) = honest
    path = tmp_path / "sandboxed_mlp-1.0-py3-none-any.whl"
    path.write_bytes(wheel)
    args = ["verify", str(bundle), "--mode", "interactive", "--response", str(response), "--nonce", b"r".hex(),
            "--challenges", str(ALL), "--json", "--method", str(path)]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["accepted"]
    assert main([*args[:-1], str(tmp_path / "missing.whl")]) == 2
    assert main([a for a in args if a != "interactive"][:2] + ["--method", str(path)]) == 2  # offline: refused
    assert "use --mode interactive or --mode online" in capsys.readouterr().err


def test_offline_a_method_replays_from_the_dataset_the_verifier_holds(honest):
    wheel, (bundle, _) = honest
    config = json.loads((bundle / "log.jsonl").read_text().splitlines()[0])["task_config"]
    held = build_task("tiny", config).dataset()  # the track's data, built by the verifier's own registered task
    v = Verifier(Trust(method=read_wheel(wheel), dataset=held), Policy(challenges=2, nonce=b"n")).verify(bundle)
    assert v.accepted and v.replayed_steps >= 2 and "verifier holds" in " ".join(v.notes), v.failures
    other = build_task("tiny", {**config, "dataset_size": config["dataset_size"] // 2}).dataset()
    with pytest.raises(VerificationError, match="not on the dataset the verifier holds"):
        Verifier(Trust(method=read_wheel(wheel), dataset=other), Policy(challenges=2, nonce=b"n")).verify(bundle)


def test_a_method_changed_after_the_run_is_refused(honest, tmp_path):
    wheel, run = honest
    changed = wheel_bytes(method_source().replace("the tiny MLP", "the tiny MLP, improved"))
    with pytest.raises(MalformedInput, match="was not trained with the method"):
        verify(changed, run)
    with pytest.raises(MalformedInput, match="pins sandboxed-mlp 1.0"):  # another version of it too
        verify(wheel_bytes(method_source(), version="1.1"), run)


LISTENER = socket.socket()
LISTENER.bind(("127.0.0.1", 0))
LISTENER.listen()
PORT = LISTENER.getsockname()[1]
SECRET = Path("/tmp/witness-test-server/server_key.pem")

ATTACKS = {
    "socket": (f"""
        import socket
        socket.create_connection(("127.0.0.1", {PORT}), timeout=3).sendall(b"the server's secrets")
    """, "Connection refused"),
    "reads the server's key": (f"""
        raise RuntimeError("leaked: " + open({str(SECRET)!r}).read())
    """, "FileNotFoundError"),
    "writes outside its scratch": ("""
        open("/tmp/witness-test-escape", "w").write("x")
        open("/usr/lib/witness-test-escape", "w").write("x")
    """, "Read-only file system"),
    "forks without end": ("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, "stopped answering"),
    "sleeps forever": ("""
        import time
        time.sleep(10 ** 6)
    """, "stopped answering"),
    "allocates without bound": ("""
        held = []
        while True:
            held.append(bytearray(1 << 26))
    """, ("MemoryError", "stopped answering")),  # its limit raises, or (the error's own report out of memory too) kills it
    "fills its disk": ("""
        for i in range(10 ** 6):
            open(f"fill{i}", "wb").write(b"x" * (8 << 20))
    """, "No space left on device"),
    "writes garbage where its answers go": ("""
        import os
        for fd in range(3, 64):
            try:
                os.write(fd, b"\\xff" * 64)
            except OSError:
                pass
        raise SystemExit(0)
    """, "stopped answering"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_method_that_attacks_the_verifier_is_rejected_and_the_verifier_goes_on(attack, honest, tmp_path):
    SECRET.parent.mkdir(exist_ok=True)
    SECRET.write_text("PRIVATE KEY")
    code, reason = ATTACKS[attack]
    evil = wheel_bytes(method_source(code))
    run = train(evil, tmp_path)  # the trainer's own machine: the method trains honestly there
    before = _cgroups()
    with pytest.raises(RunRejected) as e:
        verify(evil, run)
    v = e.value.verdict
    reasons = reason if isinstance(reason, tuple) else (reason,)
    assert not v.accepted and any(r in f for f in v.failures for r in reasons), v.failures
    assert sum(not r.passed for r in v.results) == 1  # the first failure decides: no further challenge is waited for
    assert not any("PRIVATE KEY" in f for f in v.failures)
    assert not Path("/tmp/witness-test-escape").exists()
    LISTENER.settimeout(0.1)
    with pytest.raises(TimeoutError):
        LISTENER.accept()  # nothing reached the host's network
    assert _cgroups() <= before  # every process it started is gone
    assert verify(*honest).accepted  # and the verifier goes on


def test_a_method_that_reports_outputs_instead_of_computing_them_is_rejected(honest, tmp_path):
    """Replayed, it looks for the run's records to copy (there are none where it runs), then reports a step
    it did not take: the loss and fingerprint it makes up, and its state unchanged."""
    code = """
        import os
        found = [os.path.join(d, f) for d, _, fs in os.walk("/") for f in fs if f == "log.jsonl"]
        if found:
            raise RuntimeError(f"found {found}")
    """
    source = method_source(code).replace("            evil()\n        return super().train_step(*args, **kwargs)",
                                         "            evil()\n            return StepOutput(2.5, args[3], 1.0)\n"
                                         "        return super().train_step(*args, **kwargs)")
    source = source.replace("from witness.task.tiny import TinyTask", "from witness.task.tiny import TinyTask\n"
                            "from witness.task.base import StepOutput")
    evil = wheel_bytes(source)
    run = train(evil, tmp_path)
    with pytest.raises(RunRejected) as e:
        verify(evil, run)
    failures = e.value.verdict.failures
    assert failures and all("found" not in f for f in failures), failures
    assert any("replayed loss 2.5 differs" in f for f in failures), failures


def test_an_online_run_of_a_method_replays_its_selected_steps_in_the_sandbox(tmp_path, monkeypatch):
    """The leaderboard's mode: a beacon selects steps while the run trains; the verifier, which never imports
    the method, replays exactly the selected steps in the sandbox. (Chunked openings are not yet checked for a
    method: its optimizer's bounded-move rule would be its own word.)"""
    import dataclasses
    import importlib
    import sys

    from test_online import SPEC, Beacon

    from witness.commit.signing import generate_key
    from witness.record import Commitments, Online
    from witness.record.recorder import Recorder
    from witness.task import registry

    wheel = wheel_bytes(method_source())
    beacon = Beacon(tmp_path)
    beacon.steer(hit={2, 11}, steps=16)  # (a fair draw selects no step of 16 once in a hundred runs)
    site = read_wheel(wheel).install(tmp_path / "trainer-site")
    with monkeypatch.context() as m:  # the trainer's process has the method installed; the verifier's not
        m.syspath_prepend(str(site))
        task = build_task("sandboxed-mlp", {"steps": 16})
        rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x07" * 32,
                              commit=Commitments(checkpoint_every=8),
                              online=Online(beacon=beacon.link(), spec=dataclasses.replace(SPEC, chunks=0)))
        rec.train(progress=False)
    sys.modules.pop("sandboxed_mlp", None)
    registry._built.cache_clear()
    importlib.invalidate_caches()
    v = Verifier(Trust(beacon_key=beacon.public_key, method=read_wheel(wheel)), Policy(mode="online")).verify(
        tmp_path / "run")
    selected = v.online["selected"]
    assert v.accepted and {2, 11} <= set(selected) and v.distinct_steps == len(selected), (v.failures, selected)
    assert any("ran only in the sandbox" in c for c in v.checks)
