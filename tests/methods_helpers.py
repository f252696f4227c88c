"""Submitted methods for the sandbox tests: wheels built here from source text, runs trained with them
in a process of their own (the verifying process never imports a method), and their responses."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from witness.methods.wheel import read_wheel

ALL = 10_000
HONEST = '''
"""A submitted method: the tiny MLP under its own name."""

import os

from witness.task.tiny import TinyTask


def in_sandbox():
    """The trainer runs as itself; the verifier runs the method as an unprivileged user."""
    return os.getuid() == 65534


class Method(TinyTask):
    """The method's task."""

    name = "sandboxed-mlp"

    def train_step(self, *args, **kwargs):
        if in_sandbox():
            evil()
        return super().train_step(*args, **kwargs)


def evil():
    """What the method does when it is replayed (nothing, for an honest one)."""
'''


def method_source(evil: str = "") -> str:
    """The method's module: the honest one, or one whose ``evil()`` runs when it is replayed."""
    if not evil:
        return HONEST
    return HONEST.replace('    """What the method does when it is replayed (nothing, for an honest one)."""\n',
                          '    """What the method does when it is replayed."""\n' + textwrap.indent(textwrap.dedent(evil), "    "))


def wheel_bytes(source: str, version: str = "1.0", dist: str = "sandboxed-mlp", extra: dict | None = None) -> bytes:
    """A wheel as a build backend writes it: the package, and its .dist-info with the entry point (and the
    ``extra`` files, name -> bytes, in the archive and its RECORD)."""
    info = f"sandboxed_mlp-{version}.dist-info"
    files = {
        "sandboxed_mlp/__init__.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": b"[witness.tasks]\nsandboxed-mlp = sandboxed_mlp:Method\n",
        f"{info}/top_level.txt": b"sandboxed_mlp\n",
        **(extra or {}),
    }
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return buf.getvalue()


TRAIN = '''
import sys
from witness.cli import main
from witness.verify.respond import respond
out, key, resp = sys.argv[1:4]
assert main(["train", "--task", "sandboxed-mlp", "--steps", "6", "--checkpoint-every", "3", "--quiet",
             "--key", key, "--out", out]) == 0
respond(out, resp, nonce=b"r", challenges=int(sys.argv[4]))
'''


def train(wheel: bytes, where: Path) -> tuple[Path, Path]:
    """Install the wheel where only a trainer's process sees it, train a run with it and answer every
    challenge; (bundle, response)."""
    site = read_wheel(wheel).install(where / "trainer-site")
    out, resp = where / "run", where / "response"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run([sys.executable, "-c", TRAIN, str(out), str(where / "k.pem"), str(resp), str(ALL)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, resp
