"""The self-check's sampled steps, replayed in the background while the run trains.

Step 0 and one early step are replayed in the trainer's process, right after they are recorded
(``selfcheck``). A run's later steps can still stop replaying (a kernel that picks another path for
another shape, a loop that changes after its warm-up), so the recorder also samples steps after the
early ones and has a checker process replay them (``checker``) while training goes on: the state
before a sampled step (copied when the record of the step before it is written: the committed
state a verifier replays from), its batch's samples and the state after it go to files in a
scratch folder, and the checker answers with what differs. A mismatch stops the run at the next
record or, at the latest, before the next tree head is signed, so no head ever signs a step that
failed its check.

What it may cost is a budget: ``share`` of the loop's own step time so far (1 % by default), of
which the checker's start (importing torch, building the model) and every sampled step's copies and
replay are spent. A step is sampled only while the budget holds its cost, at a random place in the
window of steps that earns it, so a short run samples none and a long one samples steps spread over
all of it. The checker runs on the CPU at the run's recorded thread count (exact replay needs that
count); a compiling recipe or a run on another device is checked at its start only. Whatever keeps
the checker from working (it cannot start, a full scratch disk, it dies) turns the background check
off with a warning: it is the trainer's aid, never a reason to stop an honest run.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from ..bundle.checkpoint import write_state
from ..task.base import StepOutput
from .mismatch import SelfCheckFailed, drawn_generators, rng_states
from .options import DEFAULT_SHARE  # noqa: F401 - the budget's default, importable from here as before

START_ESTIMATE = 4.0  # seconds a checker takes to start, until one has said (importing torch, building the task)
READY_WAIT = 120.0  # seconds a head waits at least for the checker's answer before it gives the checker up
MAX_SAMPLES_FILE = 1 << 31  # the recorder writes one batch's samples; nothing bigger is one


def write_samples(path: Path, samples: list[bytes]) -> None:
    """Write a batch's samples for the checker: a count, then each sample's length and bytes."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(samples)))
        for s in samples:
            f.write(struct.pack("<Q", len(s)))
            f.write(s)


def read_samples(path: Path) -> list[bytes]:
    """The batch's samples as ``write_samples`` wrote them (strictly: a torn or padded file is refused)."""
    raw = Path(path).read_bytes()
    if len(raw) > MAX_SAMPLES_FILE or len(raw) < 8:
        raise ValueError(f"{Path(path).name} is not a samples file")
    (n,), at, out = struct.unpack_from("<Q", raw), 8, []
    for _ in range(n):
        if at + 8 > len(raw):
            raise ValueError(f"{Path(path).name} is truncated")
        (size,) = struct.unpack_from("<Q", raw, at)
        at += 8
        if at + size > len(raw):
            raise ValueError(f"{Path(path).name} is truncated")
        out.append(raw[at : at + size])
        at += size
    if at != len(raw):
        raise ValueError(f"{Path(path).name} has bytes after its samples")
    return out


class BackgroundCheck:
    """Samples steps after the early ones and has a checker process replay them."""

    def __init__(self, rec: Any, share: float, after: int, *, steps: set[int] | None = None):  # noqa: ANN401 - the Recorder
        if not 0 <= share <= 1:
            raise ValueError(f"the self-check's share of training is a fraction in [0, 1], not {share!r}")
        self.rec, self.share, self.after = rec, share, after
        self.forced = steps  # the steps to sample whatever they cost (a test's, or a user's who asks)
        self.checked: list[int] = []
        self.parent_seconds = 0.0  # the copies this process writes
        self.child_seconds = 0.0  # the checker's start and its replays
        self.started_at: float | None = None
        self.ready = False
        self.unavailable: str | None = self._unavailable()
        self.proc: subprocess.Popen | None = None
        self.selector: selectors.BaseSelector | None = None
        self.folder: Path | None = None
        self.buffer = b""
        self.pending: list[Any] | None = None  # [step, generators' states]: a sampled step before its record
        self.in_flight: int | None = None  # the step the checker replays now
        self.job_estimate: float | None = None
        self.job_parent = 0.0  # this process's copies for the step in flight
        self.countdown: int | None = None

    def _unavailable(self) -> str | None:
        rec = self.rec
        if self.share == 0 and not self.forced:
            return "off (a share of 0)"
        if rec.task.compiles:
            return "not for a compiling recipe (its checker would compile the step again, over the budget)"
        if rec.session.device.type != "cpu":
            return f"not for a run on {rec.session.device.type} (the checker replays on the CPU)"
        return None

    # --- what the self-check calls -------------------------------------------------------
    def prepare(self, step: int) -> None:
        """``step`` is next and the recorder just committed the state before it: sample it or not;
        if so, write that state."""
        if self.unavailable is not None or (self.forced is None and step <= self.after):
            return
        if self.forced is not None and step in self.forced:
            self.settle()  # a step asked for is replayed, even if it waits for the one before
        self.poll()
        if self.unavailable is not None or self.in_flight is not None or not self._chosen(step):
            return
        began = time.perf_counter()
        try:
            self._launch()
            write_state(self.folder / f"before-{step}.safetensors",
                        self.rec.whole_state(), step, sync=False)
        except OSError as e:  # no interpreter to start, a full scratch disk, ...
            self._give_up(f"{type(e).__name__}: {e}")
            return
        self.pending = [step, None]
        self.job_parent = time.perf_counter() - began
        self.parent_seconds += self.job_parent

    def start(self, step: int) -> None:
        """The loop asks for ``step``'s batch: the global generators' states (a sampled step's
        draws outside the step's randomness are named), and any answer the checker has sent."""
        if self.pending is not None and self.pending[0] == step:
            self.pending[1] = rng_states()
        self.poll()

    def finish(self, step: int, out: StepOutput) -> None:
        """After the loop's step: hand a sampled step to the checker; collect any answer (raises
        ``SelfCheckFailed`` for a step that did not replay)."""
        if self.pending is not None and self.pending[0] == step and self.unavailable is None:
            began = time.perf_counter()
            rng = self.pending[1]
            self.pending = None
            drew = drawn_generators(rng)
            after, samples = self.folder / f"after-{step}.safetensors", self.folder / f"samples-{step}.bin"
            try:
                write_state(after, self.rec.whole_state(), step + 1, sync=False)
                write_samples(samples, self.rec.session.batch_samples(step))
            except OSError as e:
                self._give_up(f"{type(e).__name__}: {e}")
                return
            job = {"step": step, "before": str(self.folder / f"before-{step}.safetensors"), "after": str(after),
                   "samples": str(samples), "loss": float(out.loss).hex(), "lr": float(out.lr).hex(),
                   "grad_norm": float(out.grad_norm).hex(), "drew": drew, "accum": self.rec.task.grad_accum}
            self._send(job)
            self.in_flight = step
            spent = time.perf_counter() - began
            self.job_parent += spent
            self.parent_seconds += spent
        self.poll()

    def settle(self) -> None:
        """Wait for the step the checker replays now (before a tree head is signed)."""
        if self.in_flight is not None:
            self.poll(block=True)

    def close(self, now: bool = False) -> None:
        """Stop the checker (``now``: without letting it finish its step, as a failed loop stops) and
        remove its scratch folder."""
        if self.proc is not None:
            # an explicit end: a process the loop forked since (a data loader's workers) holds the
            # pipe open too, so the checker would never see its input end
            self._send({"quit": True})
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            if now:
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.selector is not None:
                self.selector.close()
                self.selector = None
            self.proc.stdout.close()
            self.proc = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    # --- what it did ---------------------------------------------------------------------
    def seconds(self) -> float:
        """What it cost: this process's copies and the checker's start and replays."""
        return self.parent_seconds + self.child_seconds

    def report(self) -> dict:
        """The sampled steps replayed, the cost, and its share of the loop's step time."""
        train = self.rec.step_seconds
        return {"steps": sorted(self.checked), "seconds": self.seconds(), "budget": self.share,
                "share": self.seconds() / train if train > 0 else 0.0, "unavailable": self.unavailable}

    def summary(self) -> str:
        """A clause for the self-check's line."""
        r = self.report()
        if r["unavailable"] is not None:
            return f"sampled steps in the background: {r['unavailable']}"
        if not r["steps"]:
            return (f"sampled steps in the background: none (a checker's start, about {START_ESTIMATE:g} s, fits "
                    f"the {100 * self.share:g} % budget after about {START_ESTIMATE / self.share:.0f} s of steps; "
                    f"this run trained {self.rec.step_seconds:.0f} s)") if self.share else "none"
        steps = r["steps"]
        shown = ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
        return (f"{len(steps)} sampled step(s) replayed in the background ({shown}; {r['seconds']:.2f} s, "
                f"{100 * r['share']:.2f} % of the loop's step time, budget {100 * self.share:g} %)")

    # --- how ----------------------------------------------------------------------------
    def _spent(self) -> float:
        # until the checker has said it is ready, its start is counted at the estimate
        started = START_ESTIMATE if self.proc is not None and not self.ready else 0.0
        return self.seconds() + started

    def _chosen(self, step: int) -> bool:
        if self.forced is not None:
            return step in self.forced
        if step >= self.rec.task.config.steps - 1 and self.proc is None:
            return False  # the last step: a checker would start only to replay it
        budget = self.share * self.rec.step_seconds - self._spent()
        done = max(step - self.rec.start_step, 1)
        mean_step = self.rec.step_seconds / done
        cost = self.job_estimate if self.job_estimate is not None else 2 * mean_step
        if self.proc is None:
            cost += START_ESTIMATE
        if budget < cost:
            self.countdown = None
            return False
        if self.countdown is None:
            # the steps that earn one check's cost: sample one of them at random, not always the first
            window = max(1, round(cost / max(self.share * mean_step, 1e-12)))
            self.countdown = secrets.randbelow(min(window, 1 << 20))
        if self.countdown > 0:
            self.countdown -= 1
            return False
        self.countdown = None
        return True

    def _launch(self) -> None:
        if self.proc is not None:
            return
        import witness

        self.folder = Path(tempfile.mkdtemp(prefix="witness-selfcheck-"))
        # a loop that dies without closing the recorder still leaves no scratch states behind
        weakref.finalize(self, shutil.rmtree, self.folder, True)
        rec, s = self.rec, self.rec.session
        spec = {"task": rec.task.name, "config": rec.task.config_json(), "run_seed": s.run_seed.hex(),
                "dataset_size": s.dataset_size, "threads": rec.manifest.get("threads", torch.get_num_threads()),
                "world_size": rec.manifest.get("world_size", 1), "parallelism": rec.manifest.get("parallelism", "none"),
                "witness": str(Path(witness.__file__).resolve()), "folder": str(self.folder)}
        # the checker imports what this process imports: this very witness and the task's plugin,
        # wherever they come from (a script's folder, a path a loop added); -P keeps the working
        # folder off its path (another copy of witness there would be imported instead)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        flags = ["-P"] if sys.version_info >= (3, 11) else []
        log = open(self.folder / "checker.log", "wb")  # noqa: SIM115 - the child holds it open
        self.started_at = time.perf_counter()
        try:
            self.proc = subprocess.Popen([sys.executable, *flags, "-m", "witness.record.checker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         close_fds=True)
        finally:
            log.close()
        self.selector = selectors.DefaultSelector()  # (select.select refuses descriptors past 1023)
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self._send(spec)

    def _send(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it stopped (or its pipe is closed): poll says why
            pass

    def _wait(self) -> float:
        """How long a head waits for the step in flight: at least ``READY_WAIT``, longer where a
        step's replay takes longer (a large model's)."""
        mean_step = self.rec.step_seconds / max(self.rec.next_step - self.rec.start_step, 1)
        return max(READY_WAIT, 5 * (self.job_estimate or 2 * mean_step) + (0 if self.ready else START_ESTIMATE))

    def poll(self, block: bool = False) -> None:
        """Read what the checker has said (``block``: until it answers the step it replays)."""
        try:
            self._read(block)
        except SelfCheckFailed:
            raise
        except Exception as e:  # noqa: BLE001 - whatever goes wrong with the checker is not the run's fault
            self._give_up(f"{type(e).__name__}: {e}")

    def _read(self, block: bool) -> None:
        deadline = time.monotonic() + self._wait()
        while self.proc is not None:
            wait = max(deadline - time.monotonic(), 0.0) if block else 0.0
            if not self.selector.select(wait):
                if block and time.monotonic() >= deadline:
                    self._give_up(f"the checker did not answer in {self._wait():.0f} s")
                return
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                self._give_up("the checker stopped")
                return
            self.buffer += chunk
            while b"\n" in self.buffer:
                line, _, self.buffer = self.buffer.partition(b"\n")
                message = json.loads(line)
                if "ready" in message:
                    self.ready = True
                    self.child_seconds += time.perf_counter() - self.started_at
                elif "error" in message:
                    self._give_up(f"the checker could not replay here: {message['error']}")
                    return
                else:
                    step = int(message["step"])
                    self.child_seconds += float(message["seconds"])
                    self.job_estimate = float(message["seconds"]) + self.job_parent
                    self.in_flight = None
                    if message["problem"]:
                        self.unavailable = "stopped at a mismatch"
                        self.close()
                        raise SelfCheckFailed(
                            message["problem"] + f" (the background self-check replayed sampled step {step} as "
                            "`witness verify` will, in a process of its own, and the bits differ: the run stopped "
                            "before its next tree head; SelfChecking(enabled=False) or --no-self-check skips "
                            "the check)")
                    self.checked.append(step)
            if not block or self.in_flight is None:
                return

    def _give_up(self, why: str) -> None:
        """The checker cannot go on (it failed to start or stopped): the run trains on, unchecked from
        here, and says so — this is not the run's fault."""
        log = ""
        if self.folder is not None and (self.folder / "checker.log").exists():
            tail = (self.folder / "checker.log").read_text(errors="replace").strip().splitlines()[-3:]
            log = " | ".join(tail)
        self.unavailable = why + (f" ({log})" if log and why.endswith("stopped") else "")
        print(f"warning: the background self-check is off for the rest of this run: {self.unavailable}",
              file=sys.stderr)
        self.in_flight = self.pending = None
        if self.proc is not None:
            self.proc.kill()
        self.close()
