"""The record-time self-check: replay a few steps just recorded the way a verifier will, and stop
at once, saying what differs and how to fix it, if the bits are not the same.

A user's own loop is witnessed by a plugin whose step must be the loop's step bit for bit; without
this check the user learns that it is not only when a verifier rejects an honest run. The check
replays step 0 and one later step drawn at random (the first 50 steps), each from a copy of the
state before it, through ``TrainingSession.step`` — what ``witness verify`` runs — and compares the
loss, the gradient norm and every tensor of the state after it. It costs two steps of compute and,
while a step is checked, a second model and a copy of the state.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import time
from typing import Any, NoReturn

import torch

from ..bundle.state import load_state, state_tensors
from ..errors import MalformedInput
from ..session import TrainingSession
from ..task.base import StepOutput
from .background import BackgroundCheck
from .mismatch import SelfCheckFailed, drawn_generators, rng_states
from .options import DEFAULT_SHARE

LATER_STEPS = 50  # the later step is drawn from steps 1 .. 50; the background samples steps after them


def check_steps(steps: int) -> list[int]:
    """Step 0 and one later step, drawn from the operating system's randomness."""
    if steps < 2:
        return [0]
    later = 1 + int.from_bytes(os.urandom(4), "big") % min(steps - 1, LATER_STEPS)
    return [0, later]


def _ulps(a: float, b: float) -> int:
    """How many representable float32 values lie between ``a`` and ``b`` (the loss is float32 here)."""
    ia, ib = (struct.unpack("<i", struct.pack("<f", x))[0] for x in (a, b))
    return abs(ia - ib)


class SelfCheck:
    """Replays the chosen steps of one recorder and compares bits.

    A step is replayed from the state the recorder committed before it: copied when the record
    of the step before is written (``prepare``), not when the loop asks for the step's batch, so
    a loop that changes the weights in between (after ``log_step``) is replayed as the verifier
    replays it, and caught. A failure is kept: every later call raises it again, so a loop that
    catches it and goes on still signs nothing after it.
    """

    def __init__(self, rec: Any, steps: list[int], share: float = DEFAULT_SHARE,  # noqa: ANN401 - the Recorder
                 sampled: set[int] | None = None):
        self.rec, self.steps = rec, set(steps)
        self.before: dict[str, torch.Tensor] | None = None
        self.prepared: int | None = None  # the step ``before`` is the committed state before
        self.rng: tuple | None = None
        self.compiled = 0
        self.checked: list[int] = []
        self.seconds = 0.0
        self.failed: SelfCheckFailed | None = None
        # the later steps, sampled and replayed by a checker process while the run trains
        self.background = BackgroundCheck(rec, share, LATER_STEPS,
                                          steps=None if sampled is None else set(sampled) - self.steps)

    def _fail(self, e: SelfCheckFailed) -> NoReturn:
        self.failed = e
        self.before = None
        raise e

    def _go_on(self) -> None:
        if self.failed is not None:
            raise self.failed  # the run stopped at a step that did not replay: nothing after it is signed

    def prepare(self, step: int) -> None:
        """The committed state before ``step`` (the recorder just committed it): keep a copy where
        ``step`` is checked, in this process or by the checker."""
        if self.failed is not None or step >= self.rec.task.config.steps:
            return
        if step in self.steps:
            started = time.perf_counter()
            self.before = {k: v.detach().clone() for k, v in self.rec.whole_state().items()}
            self.prepared = step
            self.seconds += time.perf_counter() - started
            return
        try:
            self.background.prepare(step)  # (its copies are counted as its own)
        except SelfCheckFailed as e:
            self._fail(e)

    def start(self, step: int) -> None:
        """Before the loop's step (its batch): the global generators' states, and what torch.compile
        compiled so far; and any answer the checker has sent."""
        self._go_on()
        if step in self.steps and self.prepared == step:
            self.rng = rng_states()
            self.compiled = _compiled_so_far()
            return
        try:
            self.background.start(step)
        except SelfCheckFailed as e:
            self._fail(e)

    def finish(self, step: int, out: StepOutput) -> None:
        """After the loop's step: replay it and compare (raises ``SelfCheckFailed``); at every step,
        check the logged learning rate against the schedule (the cheap audit checks each) and the
        thread count against the recorded one (replay runs at that count)."""
        self._go_on()
        rec = self.rec
        recorded = rec.manifest.get("threads")
        if recorded is not None and torch.get_num_threads() != recorded:
            self._fail(SelfCheckFailed(
                f"step {step} ran at {torch.get_num_threads()} thread(s), but the run recorded {recorded}: replay runs "
                f"at {recorded}, and a sum over threads rounds otherwise at another count, so the verifier would "
                "reject the run; leave torch's thread count as Training(threads=…) set it"))
        want = rec.lr(step)
        if not _same_float(out.lr, want):  # (the optimizer's own groups may already hold the next step's rate)
            self._fail(SelfCheckFailed(
                f"step {step} does not replay: the learning rate is not the schedule's: your loop logged {out.lr!r}, the "
                f"recipe's schedule gives {want!r} at step {step}; replay steps with the schedule's rate (rec.lr(t)), "
                "so set every parameter group's lr to rec.lr(t) before the step and log that rate (a jittered or "
                "otherwise adjusted rate is another recipe, and the verifier rejects it)"))
        if step not in self.steps or self.before is None or self.prepared != step:
            try:
                self.background.finish(step, out)
            except SelfCheckFailed as e:
                self._fail(e)
            return
        started = time.perf_counter()
        drew = drawn_generators(self.rng)
        if _compiled_so_far() != self.compiled and not rec.task.compiles:
            self._fail(SelfCheckFailed(
                f"step {step} ran code that torch.compile compiled, but the recipe does not compile: replay runs the "
                "step eagerly, and compiled kernels round differently, so the verifier would reject the run. Set "
                "compile=True in the recipe (replay then compiles the step the same way) and train rec.step_model, "
                "or train rec.model without torch.compile"))
        s = rec.session
        # as the verifier replays it: a DDP run's micro-batches in rank order, in one process
        replay = TrainingSession(rec.task, s.run_seed, s.dataset_size, rec.manifest.get("world_size", 1),
                                 rec.manifest.get("parallelism", "none"), s.device)
        try:
            load_state(replay.model, replay.optimizer, self.before)
        except MalformedInput as e:  # the loop's state is not the task's: the verifier could not load it either
            self._fail(SelfCheckFailed(f"step {step} does not replay: the state before it does not fit the task's "
                                       f"model and optimizer ({e}): your model or optimizer is not the task's"))
        got = replay.step(step, rec.session.batch_samples(step))
        after = rec.whole_state()
        replayed = state_tensors(replay.model, replay.optimizer)
        self.before = None
        problem = _compare(step, out, got, after, replayed, drew, rec.task.grad_accum)
        held = sorted({float(g["lr"]) for g in rec.optimizer.param_groups})
        if problem and "the update is not the task's" in problem and held != [want]:
            problem += (f"; the optimizer's parameter groups hold the learning rate {held[0] if len(held) == 1 else held}"
                        f", the schedule's is {want!r}: if your loop stepped with a rate of its own (jittered, "
                        "scaled, another schedule), that is the difference")
        if problem and _compiled_so_far() and not rec.task.compiles:
            problem += ("; torch.compile has compiled code in this process: if your loop runs the step compiled, set "
                        "compile=True in the recipe and train rec.step_model (replay then compiles it the same way)")
        self.seconds += time.perf_counter() - started
        if problem:
            self._fail(SelfCheckFailed(problem + " (the record-time self-check replayed the step as `witness verify` "
                                                 "will; SelfChecking(enabled=False) or --no-self-check skips it)"))
        self.checked.append(step)

    def settle(self) -> None:
        """Before a tree head is signed: wait for the sampled step being replayed (raises
        ``SelfCheckFailed`` if it did not replay, or if an earlier step did not)."""
        self._go_on()
        try:
            self.background.settle()
        except SelfCheckFailed as e:
            self._fail(e)

    def close(self, now: bool = False) -> None:
        """Stop the background checker (``now``: at once, as a failed loop stops)."""
        self.background.close(now)

    def local_seconds(self) -> float:
        """What the check cost this process (its copies and in-process replays)."""
        return self.seconds + self.background.parent_seconds

    def report(self) -> dict:
        """What the check did and what it cost."""
        return {"steps": sorted(self.checked), "seconds": self.seconds, "background": self.background.report()}

    def summary(self) -> str:
        """What the check replayed and what it cost, in a line (a run says it when it finishes)."""
        steps = " and ".join(str(t) for t in sorted(self.checked)) or "none"
        return (f"self-check: step(s) {steps} replayed as a verifier will, bit for bit ({self.seconds:.2f} s); "
                f"{self.background.summary()}; --no-self-check or SelfChecking(enabled=False) skips it")


def _compiled_so_far() -> int:
    """How many frames and graphs torch.compile has compiled in this process (it compiles a step's
    code when the step first runs it)."""
    if "torch._dynamo.utils" not in sys.modules:  # nothing compiled (and importing it costs a second or two)
        return 0
    counters = sys.modules["torch._dynamo.utils"].counters
    return sum(counters["frames"].values()) + counters["stats"]["unique_graphs"]


def _same_float(a: float, b: float) -> bool:
    """Equal, or both NaN (an fp16 step whose gradients overflowed has a NaN norm, in replay too)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _compare(step: int, out: StepOutput, got: StepOutput, after: dict[str, torch.Tensor],
             replayed: dict[str, torch.Tensor], drew: list[str], accum: int = 1) -> str | None:
    """What differs between the loop's step and the replayed one, and how to fix it; None if nothing."""
    hint_rng = ""
    if drew:
        hint_rng = (f"; your step drew from {', '.join(drew)} generator outside the step's randomness (dropout, "
                    "SDPA's dropout_p, an augmentation): compute the loss with task.step_loss(model, batch, "
                    "rec.step_seed(t)), or inside witness.task.base.step_randomness(rec.step_seed(t))")
    if not _same_float(out.loss, got.loss):
        return (f"step {step} does not replay: your loop's loss is {out.loss!r}, the task's step gives {got.loss!r} "
                f"({_ulps(out.loss, got.loss)} float32 ulp(s) apart); replay computes the task's loss, so make the "
                "task's loss the one your loop computes (its reduction too: a mean over all tokens is not a mean "
                "of per-example means; a few ulps are the same math in another order, such as torch.compile's "
                f"fused kernels: replay compiles only a recipe with compile=True){hint_rng}")
    if not _same_float(out.grad_norm, got.grad_norm):
        how = (f"after {accum} backward passes, one per micro-batch (rec.micro_batches(t)), each loss divided by "
               f"{accum} and nothing else (a factor of your own, random or not, changes the gradients)"
               if accum > 1 else "after one backward over the whole batch")
        return (f"step {step} does not replay: your loop's gradient norm is {out.grad_norm!r}, the task's step gives "
                f"{got.grad_norm!r}; replay clips as the task does (clip_grad_norm_ over all parameters at the "
                f"recipe's grad_clip) {how}{hint_rng}")
    names = sorted(set(after) | set(replayed))
    for name in names:
        a, b = after.get(name), replayed.get(name)
        if a is None or b is None:
            return (f"step {step} does not replay: {name} is in {'your' if b is None else 'the replayed'} state only; "
                    "the optimizer or the model is not the task's")
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            if name.startswith("scaler."):
                return (f"step {step} does not replay: after it, the loss scale ({name}) differs from the replayed "
                        "one: an fp16 loop scales, unscales and steps with the run's GradScaler, rec.scaler (its "
                        "scale is committed state), as task.train_step does")
            what = "optimizer state" if name.startswith("optimizer.") else "parameter or buffer"
            accumulated = (f", or the {accum} micro-batches' gradients summed in another way" if accum > 1 else "")
            return (f"step {step} does not replay: after it, the {what} {name} differs from the replayed one "
                    f"(largest difference {diff:.3g}) although the loss and gradient norm match; the update is "
                    f"not the task's: its optimizer or its settings, or the clipping{accumulated}" + hint_rng)
    return None
