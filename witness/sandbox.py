"""Running code that someone else wrote: Debian's bubblewrap (``bwrap``) with no network, a read-only
system, one scratch folder, and limits on CPU time, memory, file size, processes and wall time.

What the sandbox stops: the code sees no network (its own empty network namespace), no file of the
host but the read-only system folders, the Python it runs on and the folders it is given read-only
(never the server's database, store, keys or other runs, which are not mounted), and writes only into
its scratch folder and a small private ``/tmp``. It runs as an unprivileged user in its own user, PID,
IPC and UTS namespaces (its user maps to the one that started it, so it writes its scratch folder and
nothing that is not mounted writable), in a session of its own; it dies with its parent. A process group that forks
without end meets the pids limit (a cgroup of its own), one that allocates without end meets the
address-space limit, one that spins meets the CPU-time limit, and one that sleeps meets the wall-time
limit, after which the whole sandbox is killed. What it returns is only its exit status and what it
wrote to stdout (bounded) and to the scratch folder: a caller must treat those as untrusted input.

What it does not stop: a kernel exploit (bubblewrap is a namespace sandbox, not a VM), reading the
read-only system folders (nothing secret belongs there), and using its whole CPU and memory allowance.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/etc/alternatives", "/etc/ld.so.cache", "/etc/ssl/certs")
TMP_BYTES = 64 << 20  # the sandbox's private /tmp
PIDS_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
MEMORY_ROOTS = (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


class SandboxError(Exception):
    """The sandbox could not be set up here (no bwrap, no pids cgroup): nothing was run."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed command may use."""

    cpu_seconds: int = 600
    memory_bytes: int = 4 << 30  # address space of each process
    resident_bytes: int = 4 << 30  # memory of all its processes together, its tmpfs pages included (a cgroup)
    file_bytes: int = 1 << 30  # the largest file it may write
    processes: int = 64  # tasks (processes and threads) alive at once
    wall_seconds: float = 900.0
    output_bytes: int = 1 << 20  # stdout kept (the rest is dropped); stderr likewise


@dataclass(frozen=True)
class Result:
    """How a sandboxed command ended: its exit status (negative: killed by that signal), whether the
    wall-time limit killed it, and what it printed (at most ``Limits.output_bytes`` each)."""

    returncode: int
    timed_out: bool
    stdout: bytes
    stderr: bytes
    seconds: float


def bwrap() -> str:
    """The bubblewrap binary (``scripts/services.sh`` installs Debian's ``bubblewrap``)."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxError("bubblewrap (bwrap) is not installed: run scripts/services.sh (Debian's bubblewrap)")
    return found


def _cgroup(roots: Sequence[Path], settings: Sequence[tuple[str, ...]], what: str) -> Path:
    """A fresh cgroup under the first of ``roots`` where this process may make one and write, in order, one
    of each of ``settings``' alternatives (file, value, file, value, ...: v1's names or v2's)."""
    for root in roots:
        if not (root / "cgroup.procs").exists():
            continue
        group = root / f"witness-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            group.mkdir()
        except OSError:
            continue
        for option in settings:
            pairs = list(zip(option[::2], option[1::2], strict=True))
            if all((group / name).exists() for name, _ in pairs[:1]):
                try:
                    for name, value in pairs:
                        if (group / name).exists():
                            (group / name).write_text(value)
                    return group
                except OSError:
                    pass
        _drop_cgroup(group)
    raise SandboxError(f"no {what} cgroup can be made here (the sandbox's limit on {what} needs one): run the "
                       "workers as root, or where /sys/fs/cgroup is writable")


def _cgroups(limits: Limits) -> list[Path]:
    """A pids cgroup and a memory cgroup (one cgroup for both under v2) holding the sandbox's limits."""
    pids = _cgroup(PIDS_ROOTS, [("pids.max", str(limits.processes))], "processes")
    memory = str(limits.resident_bytes)
    if (pids / "memory.max").exists():  # v2: one cgroup holds both (a process is in one group of a hierarchy)
        try:
            (pids / "memory.max").write_text(memory)
            if (pids / "memory.swap.max").exists():
                (pids / "memory.swap.max").write_text("0")
            return [pids]
        except OSError:
            pass
    try:  # v1: memory and memory+swap (no swap beyond it); v2: memory.max and no swap
        mem = _cgroup(MEMORY_ROOTS, [("memory.limit_in_bytes", memory, "memory.memsw.limit_in_bytes", memory),
                                     ("memory.max", memory, "memory.swap.max", "0")], "memory")
    except SandboxError:
        _drop_cgroup(pids)
        raise
    return [pids, mem]


def _drop_cgroup(group: Path) -> None:
    """Kill what is left in ``group`` and remove it."""
    for _ in range(50):
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()] if group.exists() else []
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    try:
        group.rmdir()
    except OSError:
        pass


def command(argv: Sequence[str], scratch: Path, readonly: Sequence[Path] = (),
            env: dict[str, str] | None = None, scratch_bytes: int | None = None) -> list[str]:
    """The bwrap command line that runs ``argv`` in ``scratch`` (mounted at itself, writable; or, with
    ``scratch_bytes``, a tmpfs of that size at that path, which the host never sees), with ``readonly``
    folders and the Python this process runs on mounted read-only, and only ``env`` (besides PATH and
    HOME) in its environment."""
    args = [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY), "--gid",
            str(NOBODY), "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME",
            str(scratch), "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--proc", "/proc", "--dev", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    for name, value in sorted((env or {}).items()):
        args += ["--setenv", name, value]
    python = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent}
    for path in [*SYSTEM, *sorted(str(p) for p in python), *(str(Path(p).resolve()) for p in readonly)]:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    scratch = scratch.resolve()
    if scratch_bytes is None:
        args += ["--bind", str(scratch), str(scratch)]
    else:
        args += ["--size", str(scratch_bytes), "--tmpfs", str(scratch)]
    # the sandbox's root and /dev are tmpfs too, which it could otherwise fill without end (memory, not
    # disk): read-only once everything is mounted
    args += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", str(scratch), "--", *argv]
    return args


def _spawn(argv: Sequence[str], scratch: Path, readonly: Sequence[Path], limits: Limits,
           env: dict[str, str] | None = None, scratch_bytes: int | None = None) -> tuple[subprocess.Popen, list[Path]]:
    """Start ``argv`` in the sandbox (its limits set in the child before bwrap), and its cgroups."""
    if scratch_bytes is None:
        scratch.mkdir(parents=True, exist_ok=True)
    args = command(argv, scratch, readonly, env, scratch_bytes)
    groups = _cgroups(limits)

    def limit() -> None:  # in the child, before bwrap: the limits hold for everything it starts
        for group in groups:
            with open(group / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        for what, value in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                            (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))

    try:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=limit, start_new_session=True)
    except BaseException:
        for group in groups:
            _drop_cgroup(group)
        raise
    return proc, groups


def run(argv: Sequence[str], scratch: Path, readonly: Sequence[Path] = (), limits: Limits = Limits(),
        stdin: bytes = b"") -> Result:
    """Run ``argv`` in the sandbox, its scratch folder ``scratch`` (made if missing). Never raises for what
    the command does: only ``SandboxError`` where no sandbox can be made."""
    started = time.monotonic()
    proc, groups = _spawn(argv, scratch, readonly, limits)
    try:
        # its output is read as it comes and kept only up to the bound: a flood of it costs nothing here
        kept = [bytearray(), bytearray()]
        readers = [threading.Thread(target=_drain, args=(pipe, buf, limits.output_bytes), daemon=True)
                   for pipe, buf in zip((proc.stdout, proc.stderr), kept, strict=True)]
        for t in readers:
            t.start()
        try:
            proc.stdin.write(stdin)  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            for group in groups:
                _drop_cgroup(group)
            proc.wait()
        for t in readers:
            t.join(5)
    finally:
        for group in groups:
            _drop_cgroup(group)
    return Result(proc.returncode, timed_out, bytes(kept[0]), bytes(kept[1]), time.monotonic() - started)


class Conversation:
    """A sandboxed process spoken to in frames: a request (a header and a payload) on its stdin, one
    answer frame back on its stdout, each awaited at most ``timeout`` seconds, its header at most
    ``header_bytes`` and its payload at most ``payload_bytes``. Its scratch folder is a tmpfs of ``scratch_bytes`` of its own (nothing it writes
    reaches the host's disk or is read back: only its answers cross). Its stderr is kept (bounded) for
    the reason a failed process gives. ``close`` (or leaving the ``with`` block) kills it and all it
    started. A frame is two 8-byte big-endian lengths, then the header's and the payload's bytes."""

    def __init__(self, argv: Sequence[str], scratch: Path, readonly: Sequence[Path] = (), limits: Limits = Limits(),
                 env: dict[str, str] | None = None, header_bytes: int = 1 << 20, payload_bytes: int = 1 << 30,
                 scratch_bytes: int = 64 << 20):
        self.limits, self.header_bytes, self.payload_bytes = limits, header_bytes, payload_bytes
        self.deadline = time.monotonic() + limits.wall_seconds
        self.proc, self.groups = _spawn(argv, scratch, readonly, limits, env, scratch_bytes)
        self.stderr = bytearray()
        self._frames: list[tuple[bytes, bytes] | None] = []
        self._wanted = 0  # answers asked for and not yet read: the reader reads no more than these
        self._closed = False
        self._ready = threading.Condition()
        threading.Thread(target=_drain, args=(self.proc.stderr, self.stderr, limits.output_bytes), daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Read one frame for each answer asked for (what the process writes unasked waits in the pipe, holding
        nothing here); a frame over the bounds or cut short ends the conversation."""
        pipe = self.proc.stdout
        while True:
            with self._ready:
                while not self._wanted and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                self._wanted -= 1
            frame = None
            try:
                head = _exactly(pipe, 16)
                if head is not None:
                    h, n = struct.unpack(">QQ", head)
                    if h <= self.header_bytes and n <= self.payload_bytes:
                        header, payload = _exactly(pipe, h), _exactly(pipe, n)
                        frame = (header, payload) if header is not None and payload is not None else None
            except (OSError, ValueError):  # its pipe closed under it: the conversation is over
                frame = None
            with self._ready:
                self._frames.append(frame)
                self._ready.notify_all()
            if frame is None:
                return

    def ask(self, header: bytes, payload: bytes, timeout: float) -> tuple[bytes, bytes] | None:
        """Send one request, and return the answer (header, payload); None if the process ended, sent
        what is not a frame or too much, or did not answer in ``timeout`` seconds (or by the wall
        limit): it is then killed."""
        until = min(time.monotonic() + timeout, self.deadline)
        sent: list[bool] = []

        def send() -> None:  # a process that stops reading its stdin blocks the write: it waits in a thread
            try:
                self.proc.stdin.write(struct.pack(">QQ", len(header), len(payload)) + header)  # type: ignore[union-attr]
                self.proc.stdin.write(payload)  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                sent.append(True)
            except (BrokenPipeError, ValueError, OSError):
                pass

        with self._ready:
            self._wanted += 1
            self._ready.notify_all()
        writer = threading.Thread(target=send, daemon=True)
        writer.start()
        writer.join(max(0.0, until - time.monotonic()))
        if not sent:
            self.close()  # its stdin closes with it: the blocked write ends
            return None
        with self._ready:
            while not self._frames and time.monotonic() < until:
                self._ready.wait(max(0.0, until - time.monotonic()))
            frame = self._frames.pop(0) if self._frames else None
        if frame is None:
            self.close()
        return frame

    def why(self) -> str:
        """What the process said on stderr last (its traceback's last lines), for a failure's message."""
        text = bytes(self.stderr).decode("utf-8", "replace").strip().splitlines()
        return " | ".join(text[-3:])[-600:]

    def close(self) -> None:
        """Kill the process and all it started."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for group in self.groups:
            _drop_cgroup(group)
        self.proc.wait()
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()  # type: ignore[union-attr]
            except (OSError, ValueError):  # a pipe a blocked writer holds: closed once it fails
                pass

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exactly(pipe, n: int) -> bytes | None:  # noqa: ANN001 - a binary pipe
    """``n`` bytes from ``pipe`` (read into one buffer), or None where it ends first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = pipe.readinto(view[got:])
        if not k:
            return None
        got += k
    return bytes(buf) if n < 1 << 20 else buf  # type: ignore[return-value] - a large payload is not copied


def _drain(pipe, buf: bytearray, limit: int) -> None:  # noqa: ANN001 - a binary pipe
    """Read ``pipe`` to its end, keeping its first ``limit`` bytes in ``buf``."""
    while chunk := pipe.read1(1 << 16):
        if len(buf) < limit:
            buf += chunk[:limit - len(buf)]
