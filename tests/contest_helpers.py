"""Contest tracks in the tests: methods (wheels built here from source text), a live leaderboard, and
trainers that run in processes of their own with one method installed (the server never imports one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from methods_helpers import wheel_bytes

from witness.methods.wheel import read_wheel

TRACK = "golf=tiny:max_steps=12,max_tokens=2000,max_params=2000,seeds=3@accuracy+"


def method(steps: int = 12, hidden: int = 16, lr: float = 0.05, extra: str = "", top: str = "",
           fields: str = "") -> bytes:
    """A method's wheel: the tiny MLP with its own recipe (steps, width, learning rate, and ``fields``: more
    of its config's lines), and ``extra`` (the class's body, more of it) and ``top`` (module-level code) for
    methods that do more than that."""
    source = f'''
"""A contest method: the tiny MLP with a recipe of its own."""

import dataclasses
import os

import torch

from witness.task.tiny import TinyConfig, TinyTask
{textwrap.dedent(top)}

def in_sandbox():
    """The trainer runs as itself; the verifier runs the method as an unprivileged user."""
    return os.getuid() == 65534


@dataclasses.dataclass(frozen=True)
class Config(TinyConfig):
    steps: int = {steps}
    hidden: int = {hidden}
    lr: float = {lr}
{textwrap.indent(textwrap.dedent(fields), "    ")}


class Method(TinyTask):
    """The method's task."""

    name = "sandboxed-mlp"
    Config = Config
{textwrap.indent(textwrap.dedent(extra), "    ")}
'''
    return wheel_bytes(source)


def install(wheel: bytes, where: Path) -> dict:
    """The environment of a trainer's process that has the wheel installed (nowhere else is it)."""
    site = read_wheel(wheel).install(where)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}


def witness(env: dict, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``witness ARGS`` in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "witness.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert not check or done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


TRAIN_AND_SUBMIT = """
import sys
from witness.cli import main
url, track, method, key, out = sys.argv[1:]
assert main(["train", "--leaderboard", url, "--track", track, "--method", method, "--key", key, "--out", out,
             "--quiet", "--checkpoint-every", "4"]) == 0
sys.exit(main(["submit", out, "--leaderboard", url, "--no-eval", "--quiet"]))
"""


def train_and_submit(env: dict, url: str, token: str, key: Path, method_id: int, out: Path,
                     track: str = "golf") -> subprocess.CompletedProcess:
    """Train one run of the method on a ticket and submit it, as ``witness train`` and ``witness submit`` do
    (in one process of its own: one start of Python and torch)."""
    done = subprocess.run([sys.executable, "-c", TRAIN_AND_SUBMIT, url, track, str(method_id), str(key), str(out)],
                          env={**env, "WITNESS_LEADERBOARD_TOKEN": token}, cwd=out.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done
