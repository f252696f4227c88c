"""Outside the sandbox: a submitted method's task and sessions, as the verifier uses them, with every
step run by ``witness.methods.child`` in bubblewrap (``witness.sandbox``).

What crosses back is only data, read strictly: the recipe's description, losses, fingerprints and
whole states (in the checkpoint format, bounded). Everything judged is computed here by witness's own
code: the state hashes replay is held to, the parameter sketch, the data order. The child is sent no
record of the run, so a method that would rather report what the verifier expects than compute it
has nothing to copy. A method that fails, hangs, floods, or stops answering is a rejection
(``MethodFailed``); a sandbox this machine cannot make is unusable input (exit 2), never a verdict.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .. import sandbox
from ..bundle.checkpoint import read_checkpoint, write_state
from ..commit.hashing import load_json
from ..data.order import batch_indices
from ..errors import MalformedInput, VerificationError
from ..fingerprint.probes import Fingerprint
from ..fingerprint.sketch import ParameterSketch
from ..session import TrainingSession
from ..task.base import StepOutput
from .wheel import MethodWheel

RULES = ("self", "prefix32")
# what one replay of a method may use: generous for a small model on the CPU, and the same for every method
LIMITS = sandbox.Limits(cpu_seconds=3600, memory_bytes=8 << 30, file_bytes=1 << 30, processes=64,
                        wall_seconds=3600.0, output_bytes=64 << 10)
STEP_SECONDS = 600.0  # one request (a step, a state) answered within this, or the method is stopped
MAX_STATE_BYTES = 1 << 30
MAX_ANSWER_BYTES = 64 << 20  # an answer's JSON (a schedule of a million steps is about 20 MB)
SCRATCH_BYTES = 2 * MAX_STATE_BYTES  # its tmpfs: the state it writes before sending it, and room to spare


class MethodFailed(VerificationError):
    """The submitted method failed, hung or lied in the sandbox: its run is rejected."""


def check_names(wheel: MethodWheel) -> None:
    """Refuse a method whose packages are named like a module the sandbox's Python already finds (the standard
    library's, witness's, torch's, any installed distribution's): that one, not the pinned code, would run."""
    for top in wheel.tops:
        if top in sys.stdlib_module_names or top in sys.builtin_module_names or importlib.util.find_spec(top):
            raise MalformedInput(f"the method's package {top!r} has the name of a module installed where it is "
                                 "replayed, which would run instead of the method's own code: rename it")


class MethodSandbox:
    """One sandboxed process of a method's wheel (its task built from the manifest's recipe by ``describe``),
    and the other processes opened for its sessions (``spawn``), all closed with it."""

    def __init__(self, wheel: MethodWheel, task: str, threads: int, limits: sandbox.Limits | None = None):
        if task not in wheel.tasks:
            raise MalformedInput(f"the method {wheel.distribution} {wheel.version} offers no task {task!r} (it offers "
                                 f"{', '.join(sorted(wheel.tasks))})")
        check_names(wheel)
        self.wheel, self.task_name, self.threads, self.limits = wheel, task, threads, limits
        self.home = Path(tempfile.mkdtemp(prefix="witness-method-"))
        self.children: list[MethodSandbox] = []
        package = Path(__file__).resolve().parent.parent
        env = {"OMP_NUM_THREADS": str(threads)}
        if os.environ.get("MKL_CBWR"):  # the reproducible mode the run was recorded under
            env["MKL_CBWR"] = os.environ["MKL_CBWR"]
        try:
            site = wheel.install(self.home / "site")
            # -I: no PYTHONPATH, user site or sitecustomize of the method's; the wheel's folder is appended to
            # sys.path by the child, after everything installed
            argv = [sys.executable, "-I", "-B", "-m", "witness.methods.child", str(site), task, wheel.tasks[task],
                    str(threads)]
            self.conversation = sandbox.Conversation(argv, self.home / "scratch", [site, package], limits or LIMITS, env,
                                                     header_bytes=MAX_ANSWER_BYTES, payload_bytes=MAX_STATE_BYTES,
                                                     scratch_bytes=SCRATCH_BYTES)
        except sandbox.SandboxError as e:
            shutil.rmtree(self.home, ignore_errors=True)
            raise MalformedInput(f"no sandbox for the submitted method here: {e}") from None
        except OSError as e:
            shutil.rmtree(self.home, ignore_errors=True)
            raise MalformedInput(f"the method's wheel cannot be unpacked: {e}") from None

    def spawn(self) -> MethodSandbox:
        """Another process of the same method (closed with this one)."""
        child = MethodSandbox(self.wheel, self.task_name, self.threads, self.limits)
        self.children.append(child)
        return child

    def call(self, op: str, payload: bytes = b"", **args: Any) -> tuple[dict, bytes]:
        """One request; its answer's header (a JSON object) and payload, or ``MethodFailed``."""
        answer = self.conversation.ask(json.dumps({"op": op, **args}).encode(), payload, STEP_SECONDS)
        if answer is None:
            why = self.conversation.why()
            raise MethodFailed(f"the method {self.wheel.distribution} {self.wheel.version} stopped answering in the "
                               f"sandbox ({op}: it ended, hung past its limits, or sent what is not an answer)"
                               + (f": {why}" if why else ""), check="method")
        try:
            header = load_json(answer[0])
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise MethodFailed(f"the method answered {op} with what is not a JSON object", check="method")
        if "error" in header:
            raise MethodFailed(f"the method failed in the sandbox ({op}): {str(header['error'])[:600]}", check="method")
        return header, answer[1]

    def state(self, payload: bytes) -> dict[str, torch.Tensor]:
        """A state the method sent, read as strictly as a checkpoint from a stranger."""
        path = self.home / "state.safetensors"  # never mounted in the sandbox
        path.write_bytes(payload)
        try:
            return read_checkpoint(path)
        except MalformedInput as e:
            raise MethodFailed(f"the method sent a state that is not one: {e}", check="method") from None

    def close(self) -> None:
        """Stop the method (and the processes spawned from it), and remove what it was given."""
        for child in self.children:
            child.close()
        self.children = []
        self.conversation.close()
        shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> MethodSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _floats(obj: object, n: int | None, what: str) -> tuple[float, ...]:
    try:
        if isinstance(obj, list) and (n is None or len(obj) == n) and \
                all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj):
            return tuple(float(x) for x in obj)
    except OverflowError:  # an integer of hundreds of digits: JSON bounds none
        pass
    raise MethodFailed(f"the method's {what} is not a list of {n if n is not None else 'some'} numbers",
                       check="method")


class RemoteSchedule:
    """The method's learning rates, step by step, as it described them."""

    def __init__(self, lrs: tuple[float, ...]):
        self.lrs = lrs

    def at(self, step: int) -> float:
        """The learning rate at ``step``."""
        if not 0 <= step < len(self.lrs):
            raise VerificationError(f"step {step} is past the method's schedule ({len(self.lrs)} steps)",
                                    check="schedule")
        return self.lrs[step]


class RemoteTask:
    """A submitted method's task as the verifier sees it: its description, from the sandbox."""

    rebuilds_data = False  # its data is the one the verifier names, never one it generates

    def __init__(self, box: MethodSandbox, config: dict, described: dict | None = None,
                 probes: list[str] | None = None):
        self.box, self.name, self.config_given, self.probes_given = box, box.task_name, config, probes
        d = described if described is not None else box.call("describe", config=config)[0]
        try:
            self.config_json_ = d["config_json"]
            steps, batch = d["steps"], d["batch_size"]
            ints = (steps, batch, d["sketch_dims"], d["fingerprint_dims"], d["probes"] + 1, d["grad_accum"])
            if not all(type(x) is int and 0 < x < 1 << 40 for x in ints) or not isinstance(self.config_json_, dict):
                raise TypeError("a count is not a positive integer")
            self.config = SimpleNamespace(**{**self.config_json_, "steps": steps, "batch_size": batch,
                                             "sketch_dims": d["sketch_dims"], "fingerprint_dims": d["fingerprint_dims"]})
            self.probes, self.grad_accum = d["probes"], d["grad_accum"]
            self.precision, self.compiles = str(d["precision"]), bool(d["compiles"])
            self.probes_are_samples = bool(d["probes_are_samples"])
            self.document_rule = d["document_rule"]
            if self.document_rule not in RULES:
                raise TypeError(f"document rule {str(self.document_rule)[:40]!r}")
            self.flops = _floats([d["flops_per_step"]], 1, "flops per step")[0]
            self.schedule = RemoteSchedule(_floats(d["lrs"], steps, "learning-rate schedule"))
            self.parameters = [str(n) for n in d["parameters"]]
            self.aliases = [tuple(str(n) for n in g) for g in d["aliases"]]
            self._probe_bytes = None if d["probe_bytes"] is None else [_b64(p) for p in d["probe_bytes"]]
            self._probe_hash = None if d["probe_hash"] is None else bytes.fromhex(d["probe_hash"])
            self._spec = d["fingerprint_spec"]
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise MethodFailed(f"the method described its recipe wrongly: {e}", check="method") from None

    def config_json(self) -> dict:
        """The recipe as the method reads it back."""
        return self.config_json_

    def with_probes(self, probes: list[bytes]) -> RemoteTask:
        """The task with the bundle's probes (its first training samples) in place of its own."""
        given = [base64.b64encode(p).decode() for p in probes]
        d, _ = self.box.call("probes", probes=given)
        return RemoteTask(self.box, self.config_given, d, given)

    def open_box(self) -> MethodSandbox:
        """A fresh process of the method with this task built in it (for a session of its own)."""
        box = self.box.spawn()
        box.call("describe", config=self.config_given)
        if self.probes_given is not None:
            box.call("probes", probes=self.probes_given)
        return box

    def probe_bytes(self) -> list[bytes]:
        """The committed probe inputs."""
        if self._probe_bytes is None:
            raise MalformedInput("the method's probes are its first training samples: the bundle carries none")
        return self._probe_bytes

    def probe_hash(self) -> bytes:
        """The method's commitment to its probes."""
        self.probe_bytes()
        assert self._probe_hash is not None
        return self._probe_hash

    def fingerprint_spec(self) -> dict:
        """What its fingerprint holds."""
        self.probe_bytes()
        return self._spec  # type: ignore[return-value]

    def flops_per_step(self) -> float:
        """The method's own estimate (reported, never judged)."""
        return self.flops if math.isfinite(self.flops) and self.flops >= 0 else 0.0

    def dataset(self) -> Any:  # noqa: ANN401 - never returns
        """A submitted method reads no data of its own: the verifier's leaves and samples stand for it."""
        raise MalformedInput("a submitted method's run replays from the samples its bundle or response carries, "
                             "checked against the dataset's leaves: verify it in interactive or online mode")

    eval_dataset = dataset

    def collate(self, samples: list[bytes]) -> Any:  # noqa: ANN401 - never returns
        """Not here: the method's own code runs only in the sandbox."""
        raise NotImplementedError("a submitted method's code runs only in the sandbox")


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


class RemoteSession:
    """``TrainingSession``'s part that the verifier uses, with the method's steps run in the sandbox.

    Each session has a process of its own, and a process is never given a committed state that lies after
    one it is then asked to step from: it could keep the later one and answer with it instead of stepping
    (a process that was shown a later state is replaced by a fresh one before the earlier state is loaded)."""

    def __init__(self, task: RemoteTask, run_seed: bytes, dataset_size: int, world_size: int = 1,
                 parallelism: str = "none"):
        self.task, self.run_seed, self.dataset_size = task, run_seed, dataset_size
        self.args = {"run_seed": run_seed.hex(), "dataset_size": dataset_size, "world_size": world_size,
                     "parallelism": parallelism}
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)
        self.box: MethodSandbox | None = None
        self._start()

    def _start(self) -> None:
        """A fresh process, its session started from the run seed."""
        if self.box is not None:
            self.box.close()
        self.box = self.task.open_box()
        self.id, self.given = 1, -1  # the latest step of a committed state this process was given
        _, payload = self.box.call("session", session=self.id, **self.args)
        self._state: dict[str, torch.Tensor] | None = self.box.state(payload)
        self._fingerprint: Fingerprint | None = None
        missing = [n for n in self.task.parameters if f"model.{n}" not in self._state]
        if not self.task.parameters or missing:
            raise MethodFailed("the method's parameters (as it described them) are not its model's: "
                               + (f"{missing[0]} is not in its state" if missing else "it named none"), check="method")

    def batch_indices(self, step: int) -> list[int]:
        """The committed batch of ``step``: witness's own data order, from the run seed."""
        return batch_indices(self.run_seed, step, self.task.config.batch_size, self.dataset_size)

    def lr(self, step: int) -> float:
        """The method's learning rate at ``step``."""
        return self.task.schedule.at(step)

    def parameter_names(self) -> list[str]:
        """The model's parameters (the method's word: the sketch and distances are over these)."""
        return list(self.task.parameters)

    def aliases(self) -> list[tuple[str, ...]]:
        """Tied weights, by the method's model."""
        return list(self.task.aliases)

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Put the committed state after ``step`` updates into the method's session."""
        if step < self.given:
            self._start()
        self.given = max(self.given, step)
        assert self.box is not None
        path = self.box.home / "load.safetensors"
        write_state(path, tensors, 0, sync=False)
        self.box.call("load", path.read_bytes(), session=self.id)
        self._state, self._fingerprint = {k: v.clone() for k, v in tensors.items()}, None

    def step(self, step: int, samples: list[bytes]) -> StepOutput:
        """One step of the method on the samples given, in the sandbox."""
        body = struct.pack(">I", len(samples)) + b"".join(struct.pack(">Q", len(s)) + s for s in samples)
        d, _ = self.box.call("step", body, session=self.id, step=step)
        self._state = None
        self._fingerprint = self._parse_fingerprint(d)
        loss, gn = _floats([d.get("loss"), d.get("grad_norm")], 2, "loss and gradient norm")
        return StepOutput(loss, self.lr(step), gn)

    def fingerprint(self) -> Fingerprint:
        """The method's model's fingerprint on its probes (computed in the sandbox)."""
        if self._fingerprint is None:
            self._fingerprint = self._parse_fingerprint(self.box.call("fingerprint", session=self.id)[0])
        return self._fingerprint

    def _parse_fingerprint(self, d: dict) -> Fingerprint:
        fp = d.get("fingerprint")
        if not isinstance(fp, dict) or not isinstance(fp.get("digest"), str) or len(fp["digest"]) != 64:
            raise MethodFailed("the method sent no fingerprint", check="method")
        probes = len(self.task.probe_bytes())
        return Fingerprint(_floats(fp.get("probe_loss"), probes, "probe losses"),
                           _floats(fp.get("projection"), probes * self.task.config.fingerprint_dims, "projection"),
                           fp["digest"])

    def state(self) -> dict[str, torch.Tensor]:
        """The session's whole state, sent back by the method and read strictly here."""
        if self._state is None:
            self._state = self.box.state(self.box.call("state", session=self.id)[1])
        return self._state

    def sketch(self) -> list[float]:
        """The parameter sketch, computed here from the state the method sent."""
        state = self.state()
        try:
            return self.sketcher({n: state[f"model.{n}"] for n in self.task.parameters})
        except KeyError as e:
            raise MethodFailed(f"the method's state lacks its parameter {e}", check="method") from None


def open_session(task: Any, run_seed: bytes, dataset_size: int, world_size: int = 1,  # noqa: ANN401 - either kind
                 parallelism: str = "none", device: str | torch.device = "cpu") -> Any:  # noqa: ANN401
    """A session of ``task``: a ``TrainingSession`` here, or a ``RemoteSession`` in the sandbox for a
    submitted method's task."""
    if isinstance(task, RemoteTask):
        return RemoteSession(task, run_seed, dataset_size, world_size, parallelism)
    return TrainingSession(task, run_seed, dataset_size, world_size, parallelism, device)
