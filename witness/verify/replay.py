"""Replay: re-run committed steps from a known state and compare with their records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ..bundle.checkpoint import load_state, state_hash, state_tensors
from ..bundle.reader import Bundle
from ..bundle.schema import StepRecord
from ..commit.hashing import same
from ..data.dataset import Dataset
from ..errors import VerificationError
from ..fingerprint.probes import relative_distance
from ..record.session import TrainingSession
from ..task.base import Task
from .verdict import ChallengeResult

DEFAULT_THRESHOLDS = {"loss": 1e-4, "fingerprint": 1e-3, "sketch": 1e-5, "update": 1e-2}
# For one-process replay of a CPU run over more than 2 ranks, where only the order of the
# cross-rank sums differs: calibrated on honest 4-rank DDP and FSDP2 runs of `tiny`, whose worst
# distances were loss 5.3e-8, fingerprint 2.1e-7, sketch 1.5e-7, update 5.8e-6 (the last after a
# 30-step offline replay; docs/distributed.md), with a margin of about 17 to 100.
SUM_ORDER_THRESHOLDS = {"loss": 5e-6, "fingerprint": 1e-5, "sketch": 5e-6, "update": 1e-4}


class SampleSource(Protocol):
    """Where replay gets the raw samples of a batch; every sample is checked against the commitments."""

    def samples(self, step: int, indices: Sequence[int], batch_root: bytes) -> list[bytes]:
        """Canonical bytes of the batch of ``step``."""
        ...


class LocalSamples:
    """Samples from the verifier's own copy of the dataset (its root was checked against the manifest)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def samples(self, step: int, indices: Sequence[int], batch_root: bytes) -> list[bytes]:
        """Read the batch and check its root."""
        if not same(self.dataset.batch_root(indices), batch_root):
            raise VerificationError("the batch's samples do not hash to the committed batch root", step=step, check="data")
        return [self.dataset.sample_bytes(i) for i in indices]


def check_state(bundle: Bundle, session: TrainingSession, step: int, exact: bool,
                thresholds: dict[str, float]) -> None:
    """The session's state must be the one recorded after ``step`` updates (hash at 0, else fingerprint)."""
    if step == 0:
        got = state_hash(state_tensors(session.model, session.optimizer))
        if not same(got, bundle.manifest.init_state_hash):
            raise VerificationError("the initial state is not the committed one", step=0, check="state")
        return
    rec = bundle.steps[step - 1]
    fp, sk = session.fingerprint(), session.sketch()
    if exact:
        if fp.digest != rec.digest.hex() or tuple(sk) != rec.sketch:
            raise VerificationError("the state does not match the recorded fingerprint and sketch",
                                    step=step - 1, check="state")
    elif relative_distance(fp.vector(), rec.fingerprint_vector) > thresholds["fingerprint"] or \
            relative_distance(sk, rec.sketch) > thresholds["sketch"]:
        raise VerificationError("the state is too far from the recorded fingerprint and sketch",
                                step=step - 1, check="state")


class Replayer:
    """A training session that advances one committed step at a time and checks each record."""

    def __init__(self, bundle: Bundle, task: Task, source: SampleSource, exact: bool = True,
                 thresholds: dict[str, float] | None = None, norm_rtol: float = 0.0):
        m = bundle.manifest
        self.bundle, self.task, self.source, self.exact = bundle, task, source, exact
        self.thresholds = dict(DEFAULT_THRESHOLDS, **(thresholds or {}))
        self.session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.raw["parallelism"])
        self.position: int | None = None
        self.steps_run = 0
        self.norm_rtol = norm_rtol

    def load(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Set the state after ``step`` updates."""
        load_state(self.session.model, self.session.optimizer, tensors)
        self.position = step

    def sketch_before(self, step: int) -> Sequence[float] | None:
        """The recorded sketch of the state before ``step`` (None for step 0)."""
        return self.bundle.steps[step - 1].sketch if step > 0 else None

    def check_state_against_record(self, step: int) -> None:
        """The current state's fingerprint and sketch must be those recorded after ``step`` updates."""
        check_state(self.bundle, self.session, step, self.exact, self.thresholds)

    def advance(self, result: ChallengeResult | None = None) -> None:
        """Replay the step at the current position and compare everything with its record."""
        if self.position is None:
            raise RuntimeError("no state loaded")
        t = self.position
        rec = self.bundle.steps[t]
        samples = self.source.samples(t, rec.batch, rec.batch_root)
        before = self.session.sketch() if not self.exact else None
        out = self.session.step(t, samples)
        self.position = t + 1
        self.steps_run += 1
        fp, sk = self.session.fingerprint(), self.session.sketch()
        if self.exact:
            self._compare_exact(rec, out.loss, out.grad_norm, fp.digest, fp.vector(), sk)
        else:
            self._compare_tolerant(rec, out.loss, fp.vector(), sk, before, result)
        if rec.state_hash is not None and self.exact:
            got = state_hash(state_tensors(self.session.model, self.session.optimizer))
            if not same(got, rec.state_hash):
                raise VerificationError("replayed state hash differs from the committed checkpoint",
                                        step=t, check="replay")

    def _compare_exact(self, rec: StepRecord, loss: float, gn: float, digest: str, fpv: list[float], sk: list[float]) -> None:
        t = rec.step
        if not (loss == rec.loss or (math.isnan(loss) and math.isnan(rec.loss))):
            raise VerificationError(f"replayed loss {loss!r} differs from the recorded {rec.loss!r}", step=t, check="replay")
        if digest != rec.digest.hex() or fpv != rec.fingerprint_vector:
            raise VerificationError("replayed behavioral fingerprint differs from the record "
                                    f"(distance {relative_distance(fpv, rec.fingerprint_vector):.3g})", step=t, check="replay")
        if tuple(sk) != rec.sketch:
            raise VerificationError(f"replayed parameter sketch differs from the record (distance {relative_distance(sk, rec.sketch):.3g})",
                                    step=t, check="replay")
        close = self.norm_rtol > 0 and abs(gn - rec.grad_norm) <= self.norm_rtol * max(abs(rec.grad_norm), 1e-12)
        if not (gn == rec.grad_norm or close or (math.isnan(gn) and math.isnan(rec.grad_norm))):
            raise VerificationError(f"replayed gradient norm {gn!r} differs from the recorded {rec.grad_norm!r}",
                                    step=t, check="replay")

    def _compare_tolerant(self, rec: StepRecord, loss: float, fpv: list[float], sk: list[float],
                          before: list[float] | None, result: ChallengeResult | None) -> None:
        t = rec.step
        prev = self.sketch_before(t)
        d = {
            "loss": abs(loss - rec.loss) / max(abs(rec.loss), 1e-12),
            "fingerprint": relative_distance(fpv, rec.fingerprint_vector),
            "sketch": relative_distance(sk, rec.sketch),
        }
        if before is not None and prev is not None:
            d["update"] = relative_distance([a - b for a, b in zip(sk, before, strict=True)],
                               [a - b for a, b in zip(rec.sketch, prev, strict=True)])
        if result is not None:
            for k, v in d.items():
                result.distances[k] = max(result.distances.get(k, 0.0), v)
        for k, v in d.items():
            if not v <= self.thresholds[k]:
                raise VerificationError(f"{k} distance {v:.3g} exceeds the threshold {self.thresholds[k]:.3g}",
                                        step=t, check="replay")
