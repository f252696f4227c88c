"""Contest tracks: a budget a submitted method keeps, checked before it trains and again on what it
trained, and its evaluation scored blind by the track's own code.

A contest track fixes the data, the evaluation split and its metric, and a budget; the method is the
submitter's (a wheel, ``methods.wheel``). ``admit`` describes a method in the sandbox and refuses one whose
recipe already exceeds the budget, before any run of it starts. That is a courtesy to the honest: the
method's description is its own word, so ``spent`` measures what a finished run actually used from its
committed records (steps, samples, the released model's numbers), and that is what the certification holds
to the budget. ``score_blind`` runs the released model in the sandbox on the evaluation samples with their
targets hidden (``Task.hidden``) and scores its outputs outside with the registered task's ``score``: the
method never sees a target, and never computes its own score.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..bundle.checkpoint import write_state
from ..bundle.reader import Bundle
from ..data.usage import UsageCommitment
from ..errors import MalformedInput, VerificationError
from ..evals.contamination import absence_proofs
from ..evals.release import final_model_tensors
from .process import MethodFailed, MethodSandbox
from .remote import RemoteSession, RemoteTask, pack_samples
from .wheel import MethodWheel

EVAL_CHUNK = 256  # evaluation samples sent to the method in one request
ADMIT_SECONDS = 60.0  # each request of an admission (describe, the seeded state) answered within this
CAPS = ("max_steps", "max_samples", "max_tokens", "max_params")
OUTPUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Budget:
    """What one run of a contest track may use; None: no cap on that."""

    max_steps: int | None = None
    max_samples: int | None = None  # training samples seen (a step's batch counts each sample)
    max_tokens: int | None = None  # tokens of those samples, as the track's task counts them (``Task.sample_tokens``)
    max_params: int | None = None  # numbers in the released model (every tensor of its state)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and (type(value) is not int or not 1 <= value <= 1 << 50):
                raise ValueError(f"{name}={value!r}: a budget is a positive whole number")
        if not any(v is not None for v in asdict(self).values()):
            raise ValueError("a contest track caps steps, samples, tokens or parameters (max_steps, max_samples, "
                             "max_tokens, max_params)")

    def to_json(self) -> dict:
        """The track's stored form."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Budget:
        """Back from ``to_json``."""
        return cls(**{k: obj.get(k) for k in CAPS})

    def _caps(self) -> tuple[tuple[str, int | None], ...]:
        return (("steps", self.max_steps), ("training samples", self.max_samples), ("tokens", self.max_tokens),
                ("parameters", self.max_params))

    def breaches(self, steps: int, samples: int, tokens: int, params: int) -> list[str]:
        """Every cap the figures exceed, said plainly (none: within the budget)."""
        return [f"{used:,} {what}, over the track's budget of {cap:,}"
                for (what, cap), used in zip(self._caps(), (steps, samples, tokens, params), strict=True)
                if cap is not None and used > cap]

    def text(self) -> str:
        """One line for a page."""
        return "at most " + ", ".join(f"{cap:,} {what}" for what, cap in self._caps() if cap is not None)


@dataclass(frozen=True)
class Admission:
    """A method as the sandbox described it, found within a track's budget."""

    task: str
    config: dict
    steps: int
    batch_size: int
    params: int
    document_rule: str


def count_params(tensors: dict[str, torch.Tensor]) -> int:
    """The numbers in a model: every ``model.*`` tensor of a state (parameters and buffers alike), counted by
    their bytes in 4-byte words (a float32 is one, a bfloat16 half of one), so that no dtype packs more numbers
    into fewer elements (two float32 in a float64, four in an int8 quadruple)."""
    size = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("model."))
    return -(-size // 4)


def task_name(wheel: MethodWheel, name: str | None = None) -> str:
    """The task a contest entry runs: the one its wheel offers, or the one named among several."""
    if name is not None:
        if name not in wheel.tasks:
            raise MalformedInput(f"the wheel offers no task {name!r} (it offers {', '.join(sorted(wheel.tasks))})")
        return name
    if len(wheel.tasks) != 1:
        raise MalformedInput(f"the wheel offers {len(wheel.tasks)} tasks ({', '.join(sorted(wheel.tasks))}): name one")
    return next(iter(wheel.tasks))


def admit(wheel: MethodWheel, budget: Budget, data_task: Any, name: str | None = None,  # noqa: ANN401 - a Task
          threads: int = 1) -> Admission:
    """Describe the method in the sandbox and check it against the track (``data_task``: the registered task
    whose data and evaluation split the track fixes); ``MalformedInput`` saying what does not fit, or
    ``MethodFailed`` where the method fails to describe itself."""
    if not getattr(data_task, "hides_targets", False):
        raise MalformedInput(f"task {data_task.name!r} cannot score a method with its targets hidden")
    name = task_name(wheel, name)
    data = data_task.dataset()
    # an admission does not wait for the host's sandbox (``SandboxBusy``: the server answers "try later"), and
    # holds it briefly: its requests are limited to ADMIT_SECONDS each
    with MethodSandbox(wheel, name, threads, wait=0.0, step_seconds=ADMIT_SECONDS) as box:
        task = RemoteTask(box, {})
        c = task.config
        session = RemoteSession(task, b"\0" * 32, len(data))
        params = count_params(session.state())
        described_root = task.data_root
    if described_root is not None and described_root != data.root.hex():
        raise MalformedInput("the method trains on other data than the track's (its dataset's root is not the "
                             "track's)")
    if task.document_rule != data_task.document_rule:
        raise MalformedInput(f"the method names documents by rule {task.document_rule!r}; the track's data does by "
                             f"{data_task.document_rule!r}, and the track decides it")
    # tokens: at least the fewest a sample of the track's data has, for every sample (the run's own count,
    # at certification, is exact)
    fewest = min((data_task.sample_tokens(data.sample_bytes(i)) for i in range(len(data))), default=0) \
        if budget.max_tokens is not None else 0
    over = budget.breaches(c.steps, c.steps * c.batch_size, c.steps * c.batch_size * fewest, params)
    if over:
        raise MalformedInput("the method's recipe exceeds the track's budget: " + "; ".join(over))
    return Admission(name, task.config_json(), c.steps, c.batch_size, params, task.document_rule)


def spent(bundle: Bundle, data_task: Any) -> tuple[int, int, int, int]:  # noqa: ANN401 - a Task
    """What a finished run used, from its committed records: steps, training samples, their tokens (counted by
    the track's task over its data), and the numbers in its final (committed) model."""
    data = data_task.dataset()
    samples = sum(len(r.batch) for r in bundle.steps)
    tokens = sum(data_task.sample_tokens(data.sample_bytes(int(i))) for r in bundle.steps for i in r.batch)
    return len(bundle.steps), samples, tokens, count_params(final_model_tensors(bundle, "a model to hold to the budget"))


def check_budget(bundle: Bundle, budget: Budget, data_task: Any) -> str:  # noqa: ANN401 - a Task
    """Hold a finished run to the budget (``VerificationError``); the line for its verdict."""
    steps, samples, tokens, params = spent(bundle, data_task)
    over = budget.breaches(steps, samples, tokens, params)
    if over:
        raise VerificationError("the run exceeds the track's budget: " + "; ".join(over), check="budget")
    return (f"within the track's budget, by what the run committed: {steps:,} steps, {samples:,} training samples, "
            f"{tokens:,} tokens, {params:,} parameters (not what its code computes inside a step)")


def usage_of(bundle: Bundle, dataset: Any) -> UsageCommitment:  # noqa: ANN401 - a Dataset
    """The documents the run trained on, rebuilt from its batches over the track's data, and checked against
    what its end record commits."""
    usage = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps))
    want = {k: bundle.end.raw.get(k) for k in ("document_rule", "used_documents", "used_samples")}  # type: ignore[union-attr]
    if usage.to_json() != want:
        raise VerificationError("the run's end record does not commit the data its batches used", check="data usage")
    return usage


def score_blind(box: MethodSandbox, task: RemoteTask, bundle: Bundle, data_task: Any) -> tuple[list[dict], dict]:  # noqa: ANN401
    """The released model scored on every evaluation example: its outputs from the sandbox on the samples with
    their targets hidden, scored here by the track's task; (examples, aggregates)."""
    tensors = final_model_tensors(bundle, "a model to score")
    eval_set = data_task.eval_dataset()
    path = Path(box.home) / "model.safetensors"
    write_state(path, tensors, 0, sync=False)
    box.show(len(bundle.steps))
    p = task.open_process()  # (the one that described it, where it is still fresh)
    try:
        p.call("model", path.read_bytes(), run_seed=bundle.manifest.run_seed.hex())
        examples: list[dict] = []
        for lo in range(0, len(eval_set), EVAL_CHUNK):
            idx = range(lo, min(lo + EVAL_CHUNK, len(eval_set)))
            samples = [eval_set.sample_bytes(i) for i in idx]
            got = box.state(p.call("outputs", pack_samples([data_task.hidden(s) for s in samples]))[1])
            out = got.get("outputs")
            if set(got) != {"outputs"} or out is None or out.ndim < 1 or out.shape[0] != len(samples) \
                    or out.dtype not in OUTPUT_DTYPES:
                raise MethodFailed(f"the method sent no outputs for {len(samples)} evaluation samples (a tensor of "
                                   "float32, float64, float16 or bfloat16, one row a sample)", check="method")
            for i, s, o in zip(idx, samples, out, strict=True):
                try:
                    examples.append({"index": i, "sample": eval_set.hashes[i].hex(), **data_task.score(o, s)})
                except Exception as e:  # noqa: BLE001 - whatever its outputs make the scoring raise is its failure
                    raise MethodFailed(f"evaluation example {i}: {type(e).__name__}: {e}", check="method") from None
    finally:
        p.close()
    aggregates = data_task.aggregates(examples)
    if not all(math.isfinite(v) for v in aggregates.values() if isinstance(v, float)):
        raise MethodFailed("the method's outputs give no finite score", check="method")
    return examples, aggregates


def contamination(bundle: Bundle, data_task: Any) -> tuple[list, dict]:  # noqa: ANN401 - a Task
    """Every evaluation document proven absent from what the run trained on (``VerificationError`` naming
    one it trained on), and the near duplicates; (absences, near)."""
    data = data_task.dataset()
    return absence_proofs(data_task.eval_dataset().documents_list(), usage_of(bundle, data).documents,
                          data.documents_list())
