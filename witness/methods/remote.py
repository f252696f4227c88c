"""Outside the sandbox: a submitted method's task and sessions, as the verifier uses them, with every
step run by ``witness.methods.child`` in bubblewrap (``witness.methods.process``).

What crosses back is only data, read strictly: the recipe's description, losses, fingerprints and
whole states (in the checkpoint format, bounded). Everything judged is computed here by witness's own
code: the state hashes replay is held to, the parameter sketch, the data order. The method is sent no
record of the run, and committed states only in the order of their steps (``MethodSandbox.show``), so
a method that would rather report what the verifier expects than compute it has nothing to copy. A
method that fails, hangs, floods, or stops answering is a rejection (``MethodFailed``); a sandbox this
machine cannot make is unusable input (exit 2), never a verdict.
"""

from __future__ import annotations

import base64
import math
import struct
from types import SimpleNamespace
from typing import Any

import torch

from ..bundle.checkpoint import write_state
from ..data.order import batch_indices
from ..errors import MalformedInput, VerificationError
from ..fingerprint.probes import Fingerprint
from ..fingerprint.sketch import ParameterSketch
from ..session import TrainingSession
from ..task.base import StepOutput
from .process import MethodFailed, MethodSandbox, Process

RULES = ("self", "prefix32")
# what a description may say: a recipe a verifier can take in (the manifest must say the same)
MAX_STEPS, MAX_BATCH, MAX_DIMS, MAX_PROBES = 1 << 24, 1 << 20, 4096, 4096

__all__ = ["MethodFailed", "MethodSandbox", "RemoteSession", "RemoteTask", "open_session", "pack_samples"]


def _floats(obj: object, n: int | None, what: str) -> tuple[float, ...]:
    try:
        if isinstance(obj, list) and (n is None or len(obj) == n) and \
                all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj):
            return tuple(float(x) for x in obj)
    except OverflowError:  # an integer of hundreds of digits: JSON bounds none
        pass
    raise MethodFailed(f"the method's {what} is not a list of {n if n is not None else 'some'} numbers",
                       check="method")


def _count(value: object, most: int, what: str, least: int = 1) -> int:
    if type(value) is not int or not least <= value <= most:
        raise MethodFailed(f"the method's {what} is {str(value)[:40]}, not a whole number from {least} to {most}",
                           check="method")
    return value


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

    def __init__(self, method: MethodSandbox, config: dict, described: dict | None = None,
                 probes: list[str] | None = None):
        self.method, self.name, self.config_given, self.probes_given = method, method.task_name, config, probes
        self._spare: Process | None = None
        if described is None:
            # the process that described the recipe has been shown nothing of the run: the first session takes it
            p = self._spare = method.process()
            described = p.call("describe", config=config)[0]
        self._read(described)

    def _read(self, d: dict) -> None:
        try:
            self.config_json_ = d["config_json"]
            if not isinstance(self.config_json_, dict):
                raise TypeError("its config is not an object")
            steps, batch = _count(d["steps"], MAX_STEPS, "steps"), _count(d["batch_size"], MAX_BATCH, "batch size")
            sketch, dims = _count(d["sketch_dims"], MAX_DIMS, "sketch size"), \
                _count(d["fingerprint_dims"], MAX_DIMS, "fingerprint size")
            self.config = SimpleNamespace(**{**self.config_json_, "steps": steps, "batch_size": batch,
                                             "sketch_dims": sketch, "fingerprint_dims": dims})
            self.probes = _count(d["probes"], MAX_PROBES, "probe count", least=0)
            self.grad_accum = _count(d["grad_accum"], batch, "gradient accumulation")
            self.precision, self.compiles = str(d["precision"]), bool(d["compiles"])
            self.probes_are_samples = bool(d["probes_are_samples"])
            self.document_rule = d["document_rule"]
            if self.document_rule not in RULES:
                raise TypeError(f"document rule {str(self.document_rule)[:40]!r}")
            self.flops = _floats([d["flops_per_step"]], 1, "flops per step")[0]
            self.schedule = RemoteSchedule(_floats(d["lrs"], steps, "learning-rate schedule"))
            self.parameters = [str(n) for n in d["parameters"]]
            self.aliases = [tuple(str(n) for n in g) for g in d["aliases"]]
            root = d.get("data_root")  # the method's own word, only ever compared with the track's
            self.data_root = root if isinstance(root, str) and len(root) == 64 else None
            self._probe_bytes, self._probe_hash, self._spec = None, None, None
            if d["probe_bytes"] is not None or d["probe_hash"] is not None or d["fingerprint_spec"] is not None:
                self._probes_described(d)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise MethodFailed(f"the method described its recipe wrongly: {e}", check="method") from None

    def _probes_described(self, d: dict) -> None:
        """Its probes, their hash and its fingerprint's spec: all three, and the spec the sizes it described."""
        probes, spec = [_b64(p) for p in d["probe_bytes"]], d["fingerprint_spec"]
        digest = bytes.fromhex(d["probe_hash"])
        if len(digest) != 32 or not isinstance(spec, dict) or len(probes) > MAX_PROBES:
            raise TypeError("its probes, their hash and its fingerprint's spec do not go together")
        if spec.get("probes") != len(probes) or spec.get("projection_dims") != self.config.fingerprint_dims or \
                spec.get("sketch_dims") != self.config.sketch_dims:
            raise TypeError("its fingerprint's spec is not the sizes it described")
        self._probe_bytes, self._probe_hash, self._spec = probes, digest, spec

    def config_json(self) -> dict:
        """The recipe as the method reads it back."""
        return self.config_json_

    def with_probes(self, probes: list[bytes]) -> RemoteTask:
        """The task with the bundle's probes (its first training samples) in place of its own."""
        given = [base64.b64encode(p).decode() for p in probes]
        p = self._take_spare()
        if p is None:
            p = self.method.process()
            p.call("describe", config=self.config_given)
        d, _ = p.call("probes", probes=given)
        task = RemoteTask(self.method, self.config_given, d, given)
        task._spare = p  # built with exactly that task's recipe and probes, and shown nothing else
        return task

    def _take_spare(self) -> Process | None:
        """The process this task was built in, where it is still the method's live one (shown nothing since)."""
        spare, self._spare = self._spare, None
        return spare if spare is not None and spare is self.method.live and not spare.closed else None

    def open_process(self) -> Process:
        """A fresh process of the method with this task built in it (for a session): the one that described it,
        where it is still the method's live process and was given nothing since."""
        spare = self._take_spare()
        if spare is not None:
            return spare
        p = self.method.process()
        p.call("describe", config=self.config_given)
        if self.probes_given is not None:
            p.call("probes", probes=self.probes_given)
        return p

    def probe_bytes(self) -> list[bytes]:
        """The committed probe inputs."""
        if self._probe_bytes is None:
            raise MalformedInput("the method's probes are its first training samples: the bundle carries none")
        return self._probe_bytes

    def probe_hash(self) -> bytes:
        """The method's commitment to its probes."""
        self.probe_bytes()
        return self._probe_hash  # type: ignore[return-value]

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


def pack_samples(samples: list[bytes]) -> bytes:
    """Samples as the child reads them (``child.read_samples``): a count, then each one's length and bytes."""
    return struct.pack(">I", len(samples)) + b"".join(struct.pack(">Q", len(s)) + s for s in samples)


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


class RemoteSession:
    """``TrainingSession``'s part that the verifier uses, with the method's steps run in the sandbox.

    ``one_way``: a committed state is given to the method only to step from (``load``); anything else the
    verifier checks of a committed state (its sketch) it computes here (``sketch_of``). A session whose
    process was closed (another session's opened) starts a fresh one when next asked, and loads again the
    state it last loaded."""

    one_way = True

    def __init__(self, task: RemoteTask, run_seed: bytes, dataset_size: int, world_size: int = 1,
                 parallelism: str = "none"):
        self.task, self.run_seed, self.dataset_size = task, run_seed, dataset_size
        self.args = {"run_seed": run_seed.hex(), "dataset_size": dataset_size, "world_size": world_size,
                     "parallelism": parallelism}
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)
        self.proc: Process | None = None
        self.loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        self.stepped = False  # it stepped since its last load: its process holds a state nothing can give it again
        self._fingerprint: Fingerprint | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self._process()

    def _process(self) -> Process:
        """This session's process, started afresh where it was closed."""
        if self.proc is not None and not self.proc.closed:
            return self.proc
        if self.stepped:
            raise RuntimeError("a session's process was closed between its steps (the audit opened another session "
                               "in the middle of a segment)")
        p = self.proc = self.task.open_process()
        _, payload = p.call("session", session=1, **self.args)
        seeded = self.task.method.state(payload)
        missing = [n for n in self.task.parameters if f"model.{n}" not in seeded]
        if not self.task.parameters or missing:
            raise MethodFailed("the method's parameters (as it described them) are not its model's: "
                               + (f"{missing[0]} is not in its state" if missing else "it named none"), check="method")
        self._state, self._fingerprint = seeded, None
        if self.loaded is not None:
            self._send(*self.loaded)
        return p

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
        self.loaded, self.stepped = (step, {k: v.clone() for k, v in tensors.items()}), False
        if self.proc is None or self.proc.closed:
            self._process()  # which loads it
        else:
            self._send(*self.loaded)

    def _send(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.proc is not None
        self.task.method.show(step)
        path = self.task.method.home / "load.safetensors"
        write_state(path, tensors, 0, sync=False)
        self.proc.call("load", path.read_bytes(), session=1)
        self._state, self._fingerprint = {k: v.clone() for k, v in tensors.items()}, None

    def step(self, step: int, samples: list[bytes]) -> StepOutput:
        """One step of the method on the samples given, in the sandbox."""
        d, _ = self._process().call("step", pack_samples(samples), session=1, step=step)
        self.loaded, self.stepped = None, True
        self._state = None
        self._fingerprint = self._parse_fingerprint(d)
        loss, gn = _floats([d.get("loss"), d.get("grad_norm")], 2, "loss and gradient norm")
        return StepOutput(loss, self.lr(step), gn)

    def fingerprint(self) -> Fingerprint:
        """The method's model's fingerprint on its probes (computed in the sandbox)."""
        if self._fingerprint is None:
            self._fingerprint = self._parse_fingerprint(self._process().call("fingerprint", session=1)[0])
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
            self._state = self.task.method.state(self._process().call("state", session=1)[1])
        return self._state

    def sketch(self) -> list[float]:
        """The parameter sketch, computed here from the state the method sent."""
        return self.sketch_of(self.state())

    def sketch_of(self, state: dict[str, torch.Tensor]) -> list[float]:
        """The parameter sketch of a state, computed here."""
        try:
            return self.sketcher({n: state[f"model.{n}"] for n in self.task.parameters})
        except KeyError as e:
            raise MethodFailed(f"the state lacks the method's parameter {e}", check="method") from None


def open_session(task: Any, run_seed: bytes, dataset_size: int, world_size: int = 1,  # noqa: ANN401 - either kind
                 parallelism: str = "none", device: str | torch.device = "cpu") -> Any:  # noqa: ANN401
    """A session of ``task``: a ``TrainingSession`` here, or a ``RemoteSession`` in the sandbox for a
    submitted method's task."""
    if isinstance(task, RemoteTask):
        return RemoteSession(task, run_seed, dataset_size, world_size, parallelism)
    return TrainingSession(task, run_seed, dataset_size, world_size, parallelism, device)
