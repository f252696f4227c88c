"""A submitted method's processes: its wheel unpacked once, and one bubblewrap process at a time.

Sandboxes are not isolated from each other as a security property: two alive at once can signal through
the kernel (a byte-range lock on a file both read), and one can leave traces another reads later (which
pages of a system file are cached). So on a host only one method's sandbox runs at a time (``HOST_LOCK``:
admissions, audits and scoring alike), and the verifier never relies on a process being fresh. It relies on
what no process is given: the committed states are shown to the method's processes in the order of their
steps, never one before a step that is then replayed from an earlier state (``MethodSandbox.show``), so
nothing a process learns helps a later one fake a step; and no two of a method's processes are alive at
once (``MethodSandbox.process`` closes the one before). What remains is across audits: an audit of the
same run on the same machine after this one could read what this one's processes were shown (docs).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .. import sandbox
from ..bundle.checkpoint import read_checkpoint
from ..commit.hashing import load_json
from ..errors import MalformedInput, VerificationError
from .wheel import MethodWheel

# what one replay of a method may use: generous for a small model on the CPU, and the same for every method
LIMITS = sandbox.Limits(cpu_seconds=3600, memory_bytes=8 << 30, resident_bytes=6 << 30, file_bytes=1 << 30,
                        processes=64, wall_seconds=3600.0, output_bytes=64 << 10)
STEP_SECONDS = 600.0  # one request (a step, a state) answered within this, or the method is stopped
MAX_STATE_BYTES = 1 << 30
MAX_ANSWER_BYTES = 64 << 20  # an answer's JSON (a schedule of a million steps is about 20 MB)
SCRATCH_BYTES = 2 * MAX_STATE_BYTES  # its tmpfs: the state it writes before sending it, and room to spare
# one method's sandbox at a time on a host (outside every sandbox: none of them mounts it)
HOST_LOCK = Path(tempfile.gettempdir()) / "witness-method-sandbox.lock"
HOST_WAIT_SECONDS = 3600.0  # an audit waits this long for another's to end


class MethodFailed(VerificationError):
    """The submitted method failed, hung or lied in the sandbox: its run is rejected."""


class NoSandbox(MalformedInput):
    """This machine cannot make the sandbox (bubblewrap or a cgroup missing): nothing is decided about the run."""


def check_names(wheel: MethodWheel) -> None:
    """Refuse a method whose packages are named like a module the sandbox's Python already finds (the standard
    library's, witness's, torch's, any installed distribution's): that one, not the pinned code, would run."""
    for top in wheel.tops:
        if top in sys.stdlib_module_names or top in sys.builtin_module_names or importlib.util.find_spec(top):
            raise MalformedInput(f"the method's package {top!r} has the name of a module installed where it is "
                                 "replayed, which would run instead of the method's own code: rename it")


class SandboxBusy(NoSandbox):
    """Another method's sandbox runs on this host now: nothing is decided (retry later)."""


def _host_lock(wait: float) -> int:
    """Hold the host's one lock on methods' sandboxes (an open descriptor), waiting at most ``wait`` seconds."""
    fd = os.open(HOST_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise SandboxBusy("another submitted method's sandbox is running on this host; try again later") \
                    from None
            time.sleep(0.2)


class MethodSandbox:
    """A method's wheel, unpacked for its processes; at most one of them alive at a time, and on a host, one
    method's sandbox at a time (``HOST_LOCK``): two methods' processes alive at once could signal each other
    through the kernel, and an attacker controls both when it submits two (a copy admitted while its run is
    audited, or a second run whose committed states carry the first's answers).

    ``wait``: seconds to wait for the host's lock (``SandboxBusy`` after); ``step_seconds``: each request's
    limit (an admission's is short: it holds the host's lock)."""

    def __init__(self, wheel: MethodWheel, task: str, threads: int, limits: sandbox.Limits | None = None,
                 wait: float | None = None, step_seconds: float | None = None):
        if task not in wheel.tasks:
            raise MalformedInput(f"the method {wheel.distribution} {wheel.version} offers no task {task!r} (it offers "
                                 f"{', '.join(sorted(wheel.tasks))})")
        check_names(wheel)
        self.wheel, self.task_name, self.threads, self.limits = wheel, task, threads, limits
        self.step_seconds = step_seconds
        self.lock = _host_lock(HOST_WAIT_SECONDS if wait is None else wait)
        self.home = Path(tempfile.mkdtemp(prefix="witness-method-"))
        try:
            self.site = wheel.install(self.home / "site")
        except OSError as e:
            self._release()
            raise MalformedInput(f"the method's wheel cannot be unpacked: {e}") from None
        self.live: Process | None = None
        self.shown = -1  # the latest step of a committed state any of its processes was given

    def process(self) -> Process:
        """A fresh process of the method (the one alive before is closed first)."""
        if self.live is not None:
            self.live.close()
        self.live = Process(self)
        return self.live

    def show(self, step: int) -> None:
        """Note that the committed state after ``step`` updates goes to a process; refuse (an error of the
        audit's order, never of the run) to show one before a state already shown."""
        if step < self.shown:
            raise RuntimeError(f"the audit would show the method the state after {step} update(s) after the one after "
                               f"{self.shown}: a process could then answer with what another was shown")
        self.shown = step

    def state(self, payload: bytes) -> dict[str, torch.Tensor]:
        """A state the method sent, read as strictly as a checkpoint from a stranger."""
        path = self.home / "state.safetensors"  # never mounted in the sandbox
        path.write_bytes(payload)
        try:
            return read_checkpoint(path)
        except MalformedInput as e:
            raise MethodFailed(f"the method sent a state that is not one: {e}", check="method") from None

    def close(self) -> None:
        """Stop its process, and remove what it was given."""
        if self.live is not None:
            self.live.close()
            self.live = None
        self._release()

    def _release(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        if self.lock >= 0:  # only once no process of it is alive
            os.close(self.lock)
            self.lock = -1

    def __del__(self) -> None:  # one left unclosed must not hold the host's lock for this process's life
        if getattr(self, "lock", -1) >= 0:
            self.close()

    def __enter__(self) -> MethodSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Process:
    """One sandboxed process of a method (``witness.methods.child``), spoken to in frames."""

    def __init__(self, method: MethodSandbox):
        self.method, self.closed = method, False
        package = Path(__file__).resolve().parent.parent
        env = {"OMP_NUM_THREADS": str(method.threads)}
        if os.environ.get("MKL_CBWR"):  # the reproducible mode the run was recorded under
            env["MKL_CBWR"] = os.environ["MKL_CBWR"]
        # -I: no PYTHONPATH, user site or sitecustomize of the method's; the child appends the wheel's folder to
        # sys.path, after everything installed
        argv = [sys.executable, "-I", "-B", "-m", "witness.methods.child", str(method.site), method.task_name,
                method.wheel.tasks[method.task_name], str(method.threads)]
        try:
            self.conversation = sandbox.Conversation(
                argv, method.home / "scratch", [method.site, package], method.limits or LIMITS, env,
                header_bytes=MAX_ANSWER_BYTES, payload_bytes=MAX_STATE_BYTES, scratch_bytes=SCRATCH_BYTES)
        except sandbox.SandboxError as e:
            raise NoSandbox(f"no sandbox for the submitted method here: {e}") from None

    def call(self, op: str, payload: bytes = b"", **args: Any) -> tuple[dict, bytes]:
        """One request; its answer's header (a JSON object) and payload, or ``MethodFailed``."""
        if self.closed:
            raise RuntimeError("a closed process of the method was asked")
        w = self.method.wheel
        answer = self.conversation.ask(json.dumps({"op": op, **args}).encode(), payload,
                                       self.method.step_seconds or STEP_SECONDS)
        if answer is None:
            why = self.conversation.why()
            self.close()
            raise MethodFailed(f"the method {w.distribution} {w.version} stopped answering in the sandbox ({op}: it "
                               "ended, hung past its limits, or sent what is not an answer)" + (f": {why}" if why else ""),
                               check="method")
        try:
            header = load_json(answer[0])
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise MethodFailed(f"the method answered {op} with what is not a JSON object", check="method")
        if "error" in header:
            raise MethodFailed(f"the method failed in the sandbox ({op}): {str(header['error'])[:600]}", check="method")
        return header, answer[1]

    def close(self) -> None:
        """Kill it and all it started."""
        if not self.closed:
            self.closed = True
            self.conversation.close()
