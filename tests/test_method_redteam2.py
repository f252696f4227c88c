"""A second red team's attacks on the submitted-method sandbox, on the fixes of test_method_redteam.py, each as a
dishonest trainer who also writes the method: each failed before its fix."""

from __future__ import annotations

import threading

import pytest

from witness import sandbox

pytestmark = pytest.mark.skipif(sandbox.shutil.which("bwrap") is None, reason="needs bwrap")

from test_method_redteam import _described, small_limits, train, verify, wheel_plus  # noqa: E402,F401

from witness.errors import MalformedInput, RunRejected, VerificationError  # noqa: E402
from witness.methods import remote  # noqa: E402
from witness.methods.wheel import read_wheel  # noqa: E402

# --- 1. one process per session does not isolate: sandboxes alive together talk through POSIX locks ---------

LOCKSTEP = '''
"""A submitted method: the tiny MLP. Trained, its step 2 puts in weights from elsewhere. Replayed, every process
publishes each committed state it is loaded with as POSIX byte-range locks on a read-only stdlib file that every
sandbox mounts (one inode for all), and after each honest step looks there for a committed state of the same
step count, which it then becomes."""

import fcntl
import os
import struct
import sys

import torch

from witness.bundle.state import load_state, state_tensors
from witness.task.tiny import TinyTask

CALLS = [0]
SPAN = 1 << 33
CHANNEL = os.path.join(os.path.dirname(os.__file__), "antigravity.py")


def in_sandbox():
    return os.getuid() == 65534


def _slot(tensors):
    steps = sorted(k for k in tensors if k.endswith(".step"))
    return int(tensors[steps[0]].item()) if steps else 0


def _blob(tensors):
    return b"".join(tensors[k].detach().contiguous().cpu().numpy().tobytes() for k in sorted(tensors))


if in_sandbox():
    _file = open(CHANNEL, "rb")  # kept open: closing any fd of the file drops this process's locks
    _server = sys.modules["__main__"]
    _load = _server.load_state

    def _publish(model, optimizer, tensors):
        blob = _blob(tensors)
        blob += b"\\0" * (-len(blob) % 4)
        words = struct.unpack(f">{len(blob) // 4}I", blob)
        base = (_slot(tensors) + 1) << 50
        fcntl.lockf(_file, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, base + len(words))
        for i, w in enumerate(words):
            fcntl.lockf(_file, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, base + (i + 1) * SPAN + w)
        return _load(model, optimizer, tensors)

    _server.load_state = _publish


def _word(start):
    got = fcntl.fcntl(_file, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, start, SPAN, 0))
    kind, _, at, _, _ = struct.unpack("hhqqi", got)
    return None if kind == fcntl.F_UNLCK else at - start


def _published(now):
    base = (_slot(now) + 1) << 50
    n = _word(base)
    if not n:
        return None
    words = [_word(base + (i + 1) * SPAN) for i in range(n)]
    if None in words:
        return None
    blob, out, at = struct.pack(f">{n}I", *words), {}, 0
    for k in sorted(now):
        size = now[k].numel() * now[k].element_size()
        out[k] = torch.frombuffer(bytearray(blob[at:at + size]), dtype=now[k].dtype).reshape(now[k].shape).clone()
        at += size
    return out


class Method(TinyTask):
    name = "sandboxed-mlp"

    def train_step(self, model, optimizer, batch, lr, seed, clip=None):
        out = super().train_step(model, optimizer, batch, lr, seed, clip)
        CALLS[0] += 1
        if not in_sandbox():
            if CALLS[0] == 3:  # the trainer's step 2: not the method's update
                with torch.no_grad():
                    next(model.parameters()).add_(0.05)
        else:
            now = state_tensors(model, optimizer)
            seen = _published(now)
            if seen is not None and any(not torch.equal(seen[k], now[k]) for k in now):
                load_state(model, optimizer, seen)
        return out
'''


@pytest.mark.usefixtures("small_limits")
def test_rt2_sandboxes_alive_together_pass_committed_states_through_locks(tmp_path):
    """audit.run's first session (check_checkpoints loads every checkpoint into it) is never closed: it lives, with
    the describing process, while the Replayer's own session replays the steps before those checkpoints. Separate
    namespaces do not separate POSIX locks on a file they all mount read-only: F_GETLK reads another process's lock
    offsets, 64 bits a query. The checkpointing process publishes checkpoint 3, the replaying process steps 2 -> 3
    honestly and becomes checkpoint 3: the tampered step 2 is 'replayed' and accepted (the first round's copycat,
    across processes)."""
    wheel = wheel_bytes_of(LOCKSTEP)
    run = train(wheel, tmp_path, "--no-self-check")
    with pytest.raises(RunRejected) as e:
        verify(wheel, run)
    assert any("step 2" in f for f in e.value.verdict.failures), e.value.verdict.failures


def wheel_bytes_of(source: str) -> bytes:
    return wheel_plus(source, {})


@pytest.mark.usefixtures("small_limits")
def test_rt2_control_the_same_method_without_the_lock_channel_is_rejected(tmp_path):
    """Control (passes): the same tampered run, its method reading nothing from the locks, is rejected at step 2."""
    wheel = wheel_bytes_of(LOCKSTEP.replace("seen = _published(now)", "seen = None"))
    run = train(wheel, tmp_path, "--no-self-check")
    with pytest.raises(RunRejected) as e:
        verify(wheel, run)
    assert any("step 2" in f for f in e.value.verdict.failures), e.value.verdict.failures


# --- 2. the pin: a top-level module beside its package hashes like the package's module of the same name ------

from methods_helpers import method_source  # noqa: E402
from test_method_redteam import EVIL, MARK  # noqa: E402,F401


def _swapped(inside: str, beside: str) -> bytes:
    """The package imports its task from ``sandboxed_mlp/sandboxed_mlp.py`` (``inside``); a top-level
    ``sandboxed_mlp.py`` (``beside``, never imported: the package shadows it) is allowed, as its name's first
    part is a top-level name. files_sha256 names both 'sandboxed_mlp.py'."""
    return wheel_plus("from .sandboxed_mlp import Method  # noqa: F401\n",
                      {"sandboxed_mlp/sandboxed_mlp.py": inside.encode(), "sandboxed_mlp.py": beside.encode()})


def test_rt2_two_wheels_running_other_code_have_one_pin():
    """_files_sha256 maps ``pkg/pkg.py`` and a top-level ``pkg.py`` to the same entry ('pkg.py', or 'pkg/pkg.py'
    with several tops): swapping their contents keeps the pin and changes the code that runs."""
    with pytest.raises(MalformedInput, match="both as a package and as a module"):
        read_wheel(_swapped(method_source(), EVIL))


# --- 3. counts the method describes are used before anything bounds them -------------------------------------

import sys  # noqa: E402

import torch  # noqa: E402


class _Process:
    """A method's process that has answered: a session's seeded state."""

    closed = False

    def call(self, op, payload=b"", **args):
        return {}, b""

    def close(self):
        self.closed = True


class _Method:
    """A method whose process answers (``_Process``), for the checks made of what it describes."""

    task_name = "sandboxed-mlp"

    def process(self):
        return _Process()

    def state(self, payload):
        return {"model.w": torch.zeros(4)}

    def show(self, step):
        pass


def _task(**over):
    return remote.RemoteTask(_Method(), {}, _described(**over))


def test_rt2_a_huge_sketch_size_is_a_traceback():
    """sketch_dims is the method's word (describe), checked against the records' sketches only in check_records,
    after ``session.sketch()`` (its first line) builds a sketch_dims x 16384 float64 projection here, outside the
    sandbox: 2**26 is a RuntimeError (can't allocate), 2**17 takes 16 GiB of the verifier's memory. Refused as
    described."""
    with pytest.raises(VerificationError, match="sketch size"):
        _task(sketch_dims=1 << 26)
    assert remote.RemoteSession(_task(sketch_dims=8), b"\\0" * 32, 8).sketch()  # a sketch of a sane size is made


def test_rt2_a_huge_batch_size_hangs_the_verifier():
    """batch_size (< 2**40) was the method's word too: check_records computes ``session.batch_indices(t)``, a Python
    loop of batch_size iterations building a list, before comparing with the record: the verifier spun for hours.
    Refused as described."""
    with pytest.raises(VerificationError, match="batch size"):
        _task(batch_size=1 << 39)


def test_rt2_probe_bytes_without_a_probe_hash_is_an_assertion_error():
    """describe may send ``probe_bytes: []`` with ``probe_hash: null``: RemoteTask accepts it and
    ``probe_hash()`` (task_of calls it) fails its assert, an AssertionError traceback (under python -O, None
    goes on to ``same``)."""
    with pytest.raises(VerificationError, match="described its recipe wrongly"):
        _task(probe_bytes=[], probe_hash=None)


# --- 4. a closed conversation keeps its pipes and its reader thread -------------------------------------------

ECHO = """
    import os, struct, sys
    req, out = sys.stdin.buffer, os.fdopen(1, "wb")
    while (head := req.read(16)) and len(head) == 16:
        h, n = struct.unpack(">QQ", head); req.read(h); req.read(n)
        out.write(struct.pack(">QQ", 2, 0) + b"{}"); out.flush()
"""


def test_rt2_closed_conversations_leak_pipes_and_threads(tmp_path):
    """Conversation.close kills the process but closes none of its three pipes, and its reader thread waits on
    its condition for ever (``_wanted`` is 0) holding the stdout pipe: every sandboxed process a verifier ever
    started (at least three an audit of a method, and one more for each restart a challenge order causes) keeps
    three descriptors and a thread, until a long-running verifier (the leaderboard's) runs out of descriptors."""
    import gc
    import os
    import textwrap

    limits = sandbox.Limits(cpu_seconds=30, memory_bytes=1 << 30, resident_bytes=512 << 20, processes=8,
                            wall_seconds=30, output_bytes=4096)
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for i in range(5):
        conv = sandbox.Conversation([sys.executable, "-I", "-c", textwrap.dedent(ECHO)], tmp_path / str(i),
                                    limits=limits, scratch_bytes=1 << 20)
        assert conv.ask(b"{}", b"", 10) is not None
        conv.close()
        del conv
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (threading.active_count() > threads or len(os.listdir("/proc/self/fd")) > fds):
        time.sleep(0.1)
    assert len(os.listdir("/proc/self/fd")) <= fds, "descriptors kept after close"
    assert threading.active_count() <= threads, "reader threads kept after close"


import time  # noqa: E402
