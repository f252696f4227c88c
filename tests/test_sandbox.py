"""The sandbox that runs code someone else wrote (``witness.sandbox``): each escape a submitted method
might try is stopped, the sandbox ends within its limits, and the process that ran it goes on."""

from __future__ import annotations

import sys

import pytest

from witness import sandbox
from witness.sandbox import Limits, run

SMALL = Limits(cpu_seconds=20, memory_bytes=1 << 30, file_bytes=1 << 20, processes=16, wall_seconds=20,
               output_bytes=4096)


def py(code: str, tmp_path, limits: Limits = SMALL, **kw) -> sandbox.Result:
    """Run Python ``code`` in the sandbox, its scratch under ``tmp_path``."""
    return run([sys.executable, "-c", code], tmp_path / "scratch", limits=limits, **kw)


def test_honest_code_runs_reads_what_it_is_given_and_writes_its_scratch(tmp_path):
    given = tmp_path / "method"
    given.mkdir()
    (given / "data.txt").write_text("hello")
    r = py(f"import pathlib; t = pathlib.Path({str(given / 'data.txt')!r}).read_text(); "
           "pathlib.Path('out.txt').write_text(t + ' back'); print(t)", tmp_path, readonly=[given])
    assert r.returncode == 0 and not r.timed_out and r.stdout == b"hello\n", r.stderr
    assert (tmp_path / "scratch" / "out.txt").read_text() == "hello back"


def test_a_socket_reaches_nothing(tmp_path):
    r = py("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=3)", tmp_path)
    assert r.returncode != 0 and b"OSError" in r.stderr or b"Error" in r.stderr
    r = py("import socket; print(socket.if_nameindex())", tmp_path)  # only its own loopback, down
    assert r.returncode == 0 and r.stdout.strip() == b"[(1, 'lo')]", r.stdout + r.stderr


def test_the_servers_files_are_not_there(tmp_path):
    secret = tmp_path / "server"
    secret.mkdir()
    (secret / "server_key.pem").write_text("PRIVATE")
    (secret / "leaderboard.db").write_text("rows")
    for name in ("server_key.pem", "leaderboard.db"):
        r = py(f"print(open({str(secret / name)!r}).read())", tmp_path)
        assert r.returncode != 0 and b"FileNotFoundError" in r.stderr and b"PRIVATE" not in r.stdout
    # of the host's folders, only the system's and the Python it runs on (with the paths leading to them)
    r = py("import os; print(os.path.exists('/var'), os.path.exists('/home'), os.listdir('/tmp'))", tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(b"False False"), r.stdout


def test_writing_outside_its_scratch_fails(tmp_path):
    for target in ("/usr/evil", f"{sys.prefix}/evil"):
        r = py(f"open({target!r}, 'w').write('x')", tmp_path)
        assert r.returncode != 0 and b"Read-only file system" in r.stderr, r.stderr
    # beside its scratch folder lies the sandbox's own /tmp, gone with it: nothing reaches the host's
    py(f"open({str(tmp_path / 'evil')!r}, 'w').write('x')", tmp_path)
    assert not (tmp_path / "evil").exists()
    r = py("open('big', 'wb').write(b'x' * (2 << 20))", tmp_path)  # past the file-size limit
    assert r.returncode != 0


def test_a_fork_bomb_meets_the_process_limit_and_ends(tmp_path):
    r = py("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)",
           tmp_path, Limits(cpu_seconds=20, processes=16, wall_seconds=4))
    assert r.timed_out and r.seconds < 30
    assert py("print('still here')", tmp_path).stdout == b"still here\n"  # the next sandbox runs


def test_sleeping_forever_meets_the_wall_time_limit(tmp_path):
    r = py("import time; time.sleep(3600)", tmp_path, Limits(wall_seconds=2))
    assert r.timed_out and r.returncode < 0 and r.seconds < 10


def test_allocating_without_bound_meets_the_memory_limit(tmp_path):
    r = py("x = []\nwhile True:\n    x.append(bytearray(64 << 20))", tmp_path, Limits(memory_bytes=512 << 20, wall_seconds=30))
    assert r.returncode != 0 and not r.timed_out and b"MemoryError" in r.stderr


def test_a_flood_of_output_is_kept_to_its_bound(tmp_path):
    r = py("import sys\nfor _ in range(2000):\n    sys.stdout.write('x' * 65536)", tmp_path)
    assert r.returncode == 0 and len(r.stdout) == SMALL.output_bytes


def test_no_bwrap_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.SandboxError, match="bubblewrap"):
        py("print(1)", tmp_path)
