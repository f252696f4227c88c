"""Inside the sandbox: a submitted method's task, answering one frame per request.

``python -m witness.methods.child SITE TASK MODULE:CLASS THREADS`` imports the method from SITE (the
wheel unpacked, read-only) and serves ``witness.methods.remote`` over stdin and stdout in frames
(``witness.sandbox.Conversation``: a JSON header and a payload): it builds the recipe, starts
sessions, loads the states it is sent, steps on the samples it is sent and sends back the states it
reaches. It is given no record of the run, so it cannot know what the verifier expects; everything
it answers is compared or hashed outside (``remote``).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import struct
import sys
import traceback
from pathlib import Path

# the answers go out on the original stdout; anything the method prints goes to stderr instead
_ANSWERS = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402 - after stdout is taken for the answers

from ..bundle.checkpoint import read_checkpoint, write_state  # noqa: E402
from ..bundle.state import alias_groups, load_state, state_tensors  # noqa: E402
from ..session import TrainingSession  # noqa: E402
from ..task.base import Task  # noqa: E402

MAX_SAMPLES = 1 << 20


SCRATCH = Path("state.safetensors")


def read_samples(data: bytes) -> list[bytes]:
    """Samples as ``RemoteSession.step`` packs them: a count, then each sample's length and bytes."""
    (count,) = struct.unpack_from(">I", data, 0)
    out, at = [], 4
    for _ in range(min(count, MAX_SAMPLES)):
        (n,) = struct.unpack_from(">Q", data, at)
        out.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    return out


class Child:
    """The method's task and its current session."""

    def __init__(self, cls: type[Task]):
        self.cls = cls
        self.task: Task | None = None
        self.sessions: dict[int, TrainingSession] = {}
        self.scored: torch.nn.Module | None = None

    def describe(self, payload: bytes, config: dict) -> dict:
        """Build the recipe from ``config``; what the verifier asks of it."""
        self.task = self.cls.from_config(config)
        return self._described()

    def probes(self, payload: bytes, probes: list[str]) -> dict:
        """The task with the bundle's probes (its first training samples) in place of its own."""
        assert self.task is not None
        self.task = self.task.with_probes([base64.b64decode(p) for p in probes])
        return self._described()

    def _described(self) -> dict:
        task = self.task
        assert task is not None
        model = task.build_model(b"\0" * 32)
        c = task.config
        out = {"config_json": task.config_json(), "steps": c.steps, "batch_size": c.batch_size,
               "sketch_dims": c.sketch_dims, "fingerprint_dims": c.fingerprint_dims, "probes": getattr(task, "probes", 0),
               "precision": task.precision, "grad_accum": task.grad_accum, "compiles": task.compiles,
               "probes_are_samples": task.probes_are_samples, "document_rule": task.document_rule,
               "flops_per_step": task.flops_per_step(), "lrs": [task.schedule.at(t) for t in range(c.steps)],
               "parameters": [n for n, _ in model.named_parameters()],
               "aliases": [list(g) for g in alias_groups(model)], "fingerprint_spec": None, "probe_bytes": None,
               "probe_hash": None}
        try:  # the root of the data it trains on, where it can build it here (synthetic data)
            out["data_root"] = task.dataset().root.hex()
        except Exception:  # noqa: BLE001 - its data is not in the sandbox: the manifest's root is checked instead
            out["data_root"] = None
        try:  # a task whose probes are its samples knows them only once the bundle's are given
            out["probe_bytes"] = [base64.b64encode(p).decode() for p in task.probe_bytes()]
            out["probe_hash"] = task.probe_hash().hex()
            out["fingerprint_spec"] = task.fingerprint_spec()
        except Exception:  # noqa: BLE001 - its data is not here: asked again after ``probes``
            pass
        return out

    def session_(self, payload: bytes, session: int, run_seed: str, dataset_size: int, world_size: int,
                 parallelism: str) -> tuple[dict, bytes]:
        """A fresh session of a run, under its number; its seeded state sent back."""
        assert self.task is not None
        self.sessions[session] = TrainingSession(self.task, bytes.fromhex(run_seed), dataset_size, world_size,
                                                 parallelism, "cpu")
        return self.state(payload, session)

    def load(self, payload: bytes, session: int) -> dict:
        """Put the state sent into the session."""
        s = self.sessions[session]
        SCRATCH.write_bytes(payload)
        load_state(s.model, s.optimizer, read_checkpoint(SCRATCH))
        return {}

    def step(self, payload: bytes, session: int, step: int) -> dict:
        """One training step on the samples sent, and the fingerprint after it."""
        out = self.sessions[session].step(step, read_samples(payload))
        return {"loss": float(out.loss), "grad_norm": float(out.grad_norm), **self.fingerprint(b"", session)}

    def fingerprint(self, payload: bytes, session: int) -> dict:
        """The fingerprint of the session's model on the task's probes."""
        return {"fingerprint": self.sessions[session].fingerprint().to_json()}

    def model(self, payload: bytes, run_seed: str) -> dict:
        """A fresh model of the run, in eval mode, holding the model tensors sent (no optimizer: what is scored
        is the released model alone)."""
        assert self.task is not None
        self.scored = self.task.build_model(bytes.fromhex(run_seed))
        SCRATCH.write_bytes(payload)
        load_state(self.scored, None, read_checkpoint(SCRATCH))
        self.scored.eval()
        return {}

    def outputs(self, payload: bytes) -> tuple[dict, bytes]:
        """The scored model's outputs (``probe_outputs``) on the samples sent, whose targets are hidden."""
        assert self.task is not None and self.scored is not None
        with torch.no_grad():
            out = self.task.probe_outputs(self.scored, self.task.collate(read_samples(payload)))
        write_state(SCRATCH, {"outputs": out.detach().to(torch.float32).contiguous()}, 0, sync=False)
        return {}, SCRATCH.read_bytes()

    def state(self, payload: bytes, session: int) -> tuple[dict, bytes]:
        """The session's whole state, sent back in the checkpoint format."""
        s = self.sessions[session]
        write_state(SCRATCH, state_tensors(s.model, s.optimizer), 0, sync=False)
        return {}, SCRATCH.read_bytes()


def main(argv: list[str]) -> int:
    """Serve requests until stdin closes."""
    site, name, spec, threads = argv
    torch.set_num_threads(int(threads))
    sys.path.append(site)  # after everything installed: the method's names cannot shadow a module (process.check_names)
    module, _, attr = spec.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Task)) or getattr(cls, "name", None) != name:
        raise SystemExit(f"{spec} is not a witness Task named {name!r}")
    child = Child(cls)
    ops = {"describe": child.describe, "probes": child.probes, "session": child.session_, "load": child.load,
           "step": child.step, "fingerprint": child.fingerprint, "state": child.state, "model": child.model,
           "outputs": child.outputs}
    requests = sys.stdin.buffer
    while (head := requests.read(16)) and len(head) == 16:
        h, n = struct.unpack(">QQ", head)
        request, payload = json.loads(requests.read(h)), requests.read(n)
        op = request.pop("op")
        try:
            answer = ops[op](payload, **request)
        except Exception as e:  # noqa: BLE001 - the method's own failure, told to the verifier
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"[:2000]}
        header, body = (answer if isinstance(answer, tuple) else (answer, b""))
        data = json.dumps(header).encode()
        _ANSWERS.write(struct.pack(">QQ", len(data), len(body)) + data + body)
        _ANSWERS.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
