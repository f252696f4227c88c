"""A red team's attacks on the submitted-method sandbox (witness.sandbox, witness.methods), each as a dishonest
trainer who also writes the method: each failed before its fix."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import pytest

from witness import sandbox

pytestmark = pytest.mark.skipif(sandbox.shutil.which("bwrap") is None, reason="needs bwrap")

SMALL = sandbox.Limits(cpu_seconds=60, memory_bytes=2 << 30, file_bytes=16 << 20, processes=16, wall_seconds=60,
                       output_bytes=16 << 10)


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


ANSWER_ONE = """
    import os, struct, sys, time
    req = sys.stdin.buffer
    h, n = struct.unpack(">QQ", req.read(16)); req.read(h); req.read(n)
    out = os.fdopen(1, "wb")
"""


def test_rt_answer_flood_is_buffered_without_bound(tmp_path):
    """A method writes many well-formed frames (each within the bounds) on its answer fd: the verifier's
    reader thread keeps every one of them in memory (``Conversation._frames`` has no bound), so a method
    exhausts the verifier's memory with 1 GiB frames (MAX_STATE_BYTES) one after another."""
    code = ANSWER_ONE + """
    body = b"x" * (1 << 20)
    for _ in range(64):
        out.write(struct.pack(">QQ", 2, len(body)) + b"{}" + body)
        out.flush()
    time.sleep(60)
    """
    conv = sandbox.Conversation(_child(code), tmp_path / "s", limits=SMALL, header_bytes=1 << 10,
                                payload_bytes=1 << 20, scratch_bytes=1 << 20)
    try:
        assert conv.ask(b"{}", b"", 10) is not None
        deadline = time.monotonic() + 3  # what the method writes unasked stays in its pipe: nothing comes
        while time.monotonic() < deadline and len(conv._frames) < 63:
            time.sleep(0.1)
        held = sum(len(f[1]) for f in conv._frames if f is not None)
        # one answer per request: what is held beyond the one answered must stay bounded
        assert held <= 2 * conv.payload_bytes, f"the verifier holds {held >> 20} MiB of unrequested answers"
    finally:
        conv.close()


def test_rt_request_write_blocks_forever(tmp_path):
    """A method answers one request, then stops reading its stdin (sleeps, or SIGSTOPs itself; it may also
    shrink the pipe with F_SETPIPE_SZ so that any request over 4 KiB blocks). ``Conversation.ask`` writes
    the next request with no timeout: the verifier blocks forever, past STEP_SECONDS and the wall limit."""
    code = ANSWER_ONE + """
    import fcntl
    fcntl.fcntl(0, 1031, 4096)  # F_SETPIPE_SZ: the smallest pipe
    out.write(struct.pack(">QQ", 2, 0) + b"{}")
    out.flush()
    time.sleep(3600)
    """
    limits = sandbox.Limits(cpu_seconds=60, memory_bytes=2 << 30, file_bytes=16 << 20, processes=16, wall_seconds=8,
                            output_bytes=16 << 10)
    conv = sandbox.Conversation(_child(code), tmp_path / "s", limits=limits, header_bytes=1 << 10,
                                payload_bytes=1 << 20, scratch_bytes=1 << 20)
    got = []
    try:
        assert conv.ask(b"{}", b"", 10) is not None
        t = threading.Thread(target=lambda: got.append(conv.ask(b"{}", b"s" * (64 << 10), 2)), daemon=True)
        t.start()
        t.join(15)  # ask's timeout is 2 s and the wall limit 8 s
        assert not t.is_alive(), "ask() is still blocked writing the request after 15 s (timeout 2 s, wall 8 s)"
    finally:
        conv.close()  # kills the child: the blocked write fails and the thread ends


# --- a bad run accepted: the sandboxed method copies the committed states it is shown -----------------

import os  # noqa: E402
import subprocess  # noqa: E402

from methods_helpers import ALL, TRAIN, wheel_bytes  # noqa: E402

from witness.errors import MalformedInput, RunRejected  # noqa: E402
from witness.methods import process, remote  # noqa: E402
from witness.methods.wheel import read_wheel  # noqa: E402
from witness.verify.audit import Verifier  # noqa: E402
from witness.verify.policy import Evidence, Policy, Trust  # noqa: E402


@pytest.fixture()
def small_limits(monkeypatch):
    monkeypatch.setattr(process, "LIMITS", sandbox.Limits(cpu_seconds=120, memory_bytes=3 << 30, file_bytes=16 << 20,
                                                         processes=32, wall_seconds=120, output_bytes=16 << 10))
    monkeypatch.setattr(process, "STEP_SECONDS", 8.0)
    monkeypatch.setattr(process, "SCRATCH_BYTES", 64 << 20)


def train(wheel: bytes, where, *extra: str):
    """methods_helpers.train, with extra ``witness train`` options (the trainer's own choice)."""
    site = read_wheel(wheel).install(where / "trainer-site")
    out, resp = where / "run", where / "response"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    script = TRAIN.replace('"--quiet",', '"--quiet", ' + "".join(f"{e!r}, " for e in extra))
    done = subprocess.run([sys.executable, "-c", script, str(out), str(where / "k.pem"), str(resp), str(ALL)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, resp


def verify(wheel: bytes, run):
    verifier = Verifier(Trust(method=read_wheel(wheel)), Policy(challenges=ALL, nonce=b"r", mode="interactive"))
    return verifier.verify(run[0], Evidence(response=run[1]))


COPYCAT = '''
"""A submitted method: the tiny MLP. Trained, its step 2 puts in weights from elsewhere; replayed in the
sandbox, it steps honestly and then becomes any committed state it was shown that has the same step count."""

import os
import sys

import torch

from witness.bundle.state import load_state, state_tensors
from witness.task.tiny import TinyTask

TAMPER, ECHO = True, %s
SEEN, CALLS = [], [0]


def in_sandbox():
    return os.getuid() == 65534


if in_sandbox():  # the child server is __main__: remember every state the verifier loads
    _server = sys.modules["__main__"]
    _load = _server.load_state

    def _remember(model, optimizer, tensors):
        SEEN.append({k: v.clone() for k, v in tensors.items()})
        return _load(model, optimizer, tensors)

    _server.load_state = _remember


class Method(TinyTask):
    name = "sandboxed-mlp"

    def train_step(self, model, optimizer, batch, lr, seed, clip=None):
        out = super().train_step(model, optimizer, batch, lr, seed, clip)
        CALLS[0] += 1
        if not in_sandbox():
            if TAMPER and CALLS[0] == 3:  # the trainer's step 2: not the method's update
                with torch.no_grad():
                    next(model.parameters()).add_(0.05)
        elif ECHO:
            now = state_tensors(model, optimizer)
            steps = [k for k in now if k.endswith(".step")]
            for seen in SEEN:
                if seen.keys() == now.keys() and all(torch.equal(seen[k], now[k]) for k in steps) \\
                        and any(not torch.equal(seen[k], now[k]) for k in now):
                    load_state(model, optimizer, seen)
                    break
        return out
'''


def test_rt_control_a_tampered_step_is_rejected_by_a_method_that_does_not_copy(small_limits, tmp_path):
    """Control (passes): the trainer's step 2 is not the method's update, and honest replay sees it."""
    wheel = wheel_bytes(COPYCAT % "False")
    run = train(wheel, tmp_path, "--no-self-check")
    with pytest.raises(RunRejected) as e:
        verify(wheel, run)
    assert any("step 2" in f for f in e.value.verdict.failures), e.value.verdict.failures


def test_rt_method_copies_committed_states_it_was_shown_and_is_accepted(small_limits, tmp_path):
    """check_checkpoints loads every checkpoint (and replay every segment start) into the SAME sandboxed
    process that later replays the steps before them: the method keeps them and, after an honest-looking
    step, swaps in the committed state of the same step count. The tampered transition 2 -> 3 is then
    'replayed' and accepted, though the method's update never produced it (remote.py: "the child is sent
    no record of the run ... has nothing to copy" does not hold: it is sent the committed states)."""
    wheel = wheel_bytes(COPYCAT % "True")
    run = train(wheel, tmp_path, "--no-self-check")
    with pytest.raises(RunRejected) as e:
        verify(wheel, run)
    assert any("step 2" in f for f in e.value.verdict.failures), e.value.verdict.failures


# --- the pin does not bind the code that runs -----------------------------------------------------------

import py_compile  # noqa: E402

from methods_helpers import method_source  # noqa: E402


def wheel_plus(source: str, extra: dict[str, bytes]) -> bytes:
    """methods_helpers.wheel_bytes with more files in the archive (and in its RECORD)."""
    return wheel_bytes(source, extra=extra)


MARK = "UNPINNED CODE RAN IN THE SANDBOX"
EVIL = method_source(f'raise RuntimeError("{MARK}")\n')


def unchecked_pyc(source: str, tmp_path) -> bytes:
    """``source`` compiled to a hash-based pyc that Python loads without looking at the .py beside it."""
    src, out = tmp_path / "m.py", tmp_path / "m.pyc"
    src.write_text(source)
    py_compile.compile(str(src), str(out), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return out.read_bytes()


def _extras(tmp_path) -> dict[str, dict[str, bytes]]:
    tag = sys.implementation.cache_tag
    return {
        "unchecked pyc in __pycache__": {f"sandboxed_mlp/__pycache__/__init__.{tag}.pyc": unchecked_pyc(EVIL, tmp_path)},
        "sitecustomize.py beside the package": {"sitecustomize.py": f"raise SystemExit({MARK!r})\n".encode()},
        "sourceless module": {"sandboxed_mlp/helper.pyc": unchecked_pyc("X = 1\n", tmp_path)},
    }


@pytest.mark.parametrize("what", ["unchecked pyc in __pycache__", "sitecustomize.py beside the package",
                                  "sourceless module"])
def test_rt_two_wheels_with_other_code_have_one_pin(what, tmp_path):
    """files_sha256 (the manifest's pin, and registry.package_files_sha256 on the trainer's side) leaves out
    .pyc files and any top-level file not in top_level.txt; yet Python runs both (a hash-based unchecked
    pyc is used without reading the .py; sitecustomize.py on PYTHONPATH runs at start-up): such a wheel
    is refused."""
    with pytest.raises(MalformedInput, match="compiled bytecode|outside its packages"):
        read_wheel(wheel_plus(method_source(), _extras(tmp_path)[what]))


def test_rt_verifier_replays_code_the_run_did_not_pin(small_limits, tmp_path):
    """A run trained with the honest wheel; the verifier is handed a wheel with the same pin whose cached
    bytecode is other code: it passes the pin check (task_of) and that code is what runs in the sandbox."""
    honest = wheel_plus(method_source(), {})
    run = train(honest, tmp_path)
    other = wheel_plus(method_source(), _extras(tmp_path)["unchecked pyc in __pycache__"])
    with pytest.raises(MalformedInput, match="compiled bytecode"):
        verify(other, run)


# --- answers that crash the verifier with a traceback ---------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from witness.commit.hashing import load_json  # noqa: E402
from witness.errors import VerificationError  # noqa: E402


def _described(**over) -> dict:
    d = {"config_json": {"steps": 2}, "steps": 2, "batch_size": 4, "sketch_dims": 8, "fingerprint_dims": 4,
         "probes": 2, "precision": "fp32", "grad_accum": 1, "compiles": False, "probes_are_samples": False,
         "document_rule": "self", "flops_per_step": 1.0, "lrs": [0.1, 0.1], "parameters": ["w"], "aliases": [],
         "fingerprint_spec": None, "probe_bytes": None, "probe_hash": None}
    d.update(over)
    return d


@pytest.mark.parametrize("over", ["flops_per_step", "lrs"])
def test_rt_a_huge_integer_in_the_description_is_a_traceback(over):
    """JSON integers are unbounded: 1e400 written as an integer passes ``load_json`` and the int checks of
    ``_floats``, then ``float()`` raises OverflowError, which RemoteTask does not catch (nor
    ``_floats`` for losses, gradient norms, probe losses and projections in step answers)."""
    big = "1" + "0" * 400
    flops, lr = (big if over == "flops_per_step" else "1.0"), (big if over == "lrs" else "0.1")
    raw = f'{{"flops_per_step": {flops}, "lrs": [{lr}, 0.1]}}'
    d = _described(**load_json(raw))
    with pytest.raises(VerificationError):
        remote.RemoteTask(SimpleNamespace(task_name="sandboxed-mlp"), {}, d)


def test_rt_a_wheel_with_a_file_and_a_folder_of_one_name_is_a_traceback(tmp_path):
    """``read_wheel`` accepts ``pkg/x.py`` and ``pkg/x.py/y.py``; ``MethodWheel.install`` then raises
    FileExistsError/NotADirectoryError (not MalformedInput) from MethodSandbox(), and leaves its temp dir."""
    with pytest.raises(MalformedInput, match="both as a file and as a folder"):
        read_wheel(wheel_plus(method_source(), {"sandboxed_mlp/x.py": b"", "sandboxed_mlp/x.py/y.py": b""}))


def test_rt_memory_limit_is_per_process_not_per_sandbox(tmp_path):
    """RLIMIT_AS bounds each process; the pids cgroup allows ``processes`` of them and no memory cgroup
    bounds their sum (nor the scratch tmpfs, 2 GiB of RAM in process.SCRATCH_BYTES): with process.LIMITS a
    method could hold 64 x 8 GiB + 2 GiB of the verifier host's memory. Here: 4 x 200 MiB, each under a
    256 MiB limit, meet the sandbox's memory cgroup of 300 MiB."""
    code = ANSWER_ONE + """
    for _ in range(4):
        if os.fork() == 0:
            held = b"x" * (200 << 20)
            time.sleep(60)
            os._exit(0)
    time.sleep(3)
    out.write(struct.pack(">QQ", 2, 0) + b"{}")
    out.flush()
    time.sleep(60)
    """
    limits = sandbox.Limits(cpu_seconds=60, memory_bytes=256 << 20, resident_bytes=300 << 20, file_bytes=16 << 20,
                            processes=16, wall_seconds=60, output_bytes=16 << 10)
    conv = sandbox.Conversation(_child(code), tmp_path / "s", limits=limits, header_bytes=1 << 10,
                                payload_bytes=1 << 20, scratch_bytes=1 << 20)
    try:
        assert conv.ask(b"{}", b"", 20) is not None
        rss = 0
        for pid in (conv.groups[0] / "cgroup.procs").read_text().split():
            try:
                status = open(f"/proc/{pid}/status").read()
            except OSError:
                continue
            rss += int(next((ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS:")), "0")) << 10
        assert rss <= limits.resident_bytes, f"the sandbox holds {rss >> 20} MiB under a {limits.resident_bytes >> 20} MiB limit"
    finally:
        conv.close()
