"""The background self-check's replaying process: ``python -m witness.record.checker``.

It is a process of its own, not a thread of the trainer's: replay seeds torch's, Python's and
NumPy's global generators (a thread would draw from the generators the user's loop draws from),
and a thread of its own would run torch's kernels with another OpenMP team size than the one the
run records. It reads one JSON line that names the run (task, recipe, seed, thread count), builds
the run's model and optimizer as ``witness verify`` does, says it is ready, then replays one step
per JSON line it is sent: from the state before it (a file the recorder wrote), on the batch's
canonical samples (another file), and compares the loss, the gradient norm and every tensor of the
state after it with the recorder's (a third file). It answers with what differs, or nothing, in a
JSON line on the pipe the recorder handed it. It reads only files the recorder it serves wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path


def main() -> int:
    """Serve replay jobs on standard input until it closes."""
    # replies go on a descriptor of their own: whatever a library prints lands on standard error
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def say(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    spec = json.loads(sys.stdin.readline() or "{}")
    try:
        return _serve(spec, say)
    finally:
        # the scratch states go with the checker, however the trainer ended (SIGTERM runs no finalizer)
        if spec.get("folder"):
            shutil.rmtree(spec["folder"], ignore_errors=True)


def _serve(spec: dict, say) -> int:  # noqa: ANN001 - a function that sends a reply
    try:
        import torch

        torch.set_num_threads(int(spec["threads"]))
        import witness

        from ..bundle.checkpoint import read_checkpoint
        from ..bundle.state import load_state, state_tensors
        from ..errors import MalformedInput
        from ..session import TrainingSession
        from ..task.base import StepOutput
        from ..task.registry import build_task
        from .background import read_samples
        from .selfcheck import _compare

        here = str(Path(witness.__file__).resolve())
        if spec.get("witness") and here != spec["witness"]:
            raise ValueError(f"this checker imports witness from {here}, the trainer from {spec['witness']}")
        task = build_task(spec["task"], spec["config"])
        if task.config_json() != spec["config"]:
            raise ValueError(f"the task {spec['task']!r} does not build the run's recipe here")
        # a DDP run's step is replayed as the verifier replays it: its ranks' micro-batches in rank order
        session = TrainingSession(task, bytes.fromhex(spec["run_seed"]), int(spec["dataset_size"]),
                                  int(spec.get("world_size", 1)), str(spec.get("parallelism", "none")))
    except Exception as e:  # noqa: BLE001 - whatever stops it, the recorder reports it and trains on
        say({"error": f"{type(e).__name__}: {e}"})
        return 1
    say({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            return 0
        started = time.perf_counter()
        step = int(job["step"])
        try:
            before = read_checkpoint(Path(job["before"]))
            try:
                load_state(session.model, session.optimizer, before)
            except MalformedInput as e:  # the loop's state is not the task's: a verifier could not load it either
                say({"step": step, "seconds": time.perf_counter() - started,
                     "problem": f"step {step} does not replay: the state before it does not fit the task's model "
                                f"and optimizer ({e}): your model or optimizer is not the task's"})
                continue
            got = session.step(step, read_samples(Path(job["samples"])))
            after = read_checkpoint(Path(job["after"]))
            out = StepOutput(float.fromhex(job["loss"]), float.fromhex(job["lr"]), float.fromhex(job["grad_norm"]))
            problem = _compare(step, out, got, after, state_tensors(session.model, session.optimizer),
                               list(job["drew"]), int(job["accum"]))
        except Exception as e:  # noqa: BLE001 - a job that cannot run is the checker's failure, not the run's
            say({"step": step, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)})
            return 1
        finally:
            for name in ("before", "after", "samples"):
                Path(job[name]).unlink(missing_ok=True)
        say({"step": step, "problem": problem, "seconds": time.perf_counter() - started})
    return 0


if __name__ == "__main__":
    sys.exit(main())
