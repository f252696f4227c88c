"""The probe-and-evaluation half of the Task protocol: the committed probe set, the behavioral
fingerprint taken on it, and the per-example evaluation metric (``base.Task`` inherits it)."""

from __future__ import annotations

import copy
import math
from typing import Any, TypeVar

import torch
from torch import nn

from ..commit.hashing import canonical_json, sha256
from ..data.dataset import Dataset
from ..fingerprint.probes import Fingerprint, fingerprint_from_outputs, projection_matrix

P = TypeVar("P", bound="TaskProbes")


class TaskProbes:
    """Probes, fingerprint and evaluation of a task; ``Task`` supplies ``name``, ``config``,
    ``probes_are_samples``, ``collate`` and ``recorded_probe_outputs``."""

    name: str
    config: Any
    probes_are_samples: bool
    _probes: Any
    _proj: torch.Tensor | None

    # --- probes -------------------------------------------------------------------------
    def probe_bytes(self) -> list[bytes]:
        """The committed probe inputs, as canonical bytes."""
        raise NotImplementedError

    def with_probes(self: P, probes: list[bytes]) -> P:
        """This task with the given probe inputs (a bundle's, its hash checked against the manifest)
        in place of those it would read from its training data."""
        if not self.probes_are_samples:
            raise ValueError(f"the probes of task {self.name!r} are its own, not samples of its data")
        task = copy.copy(self)
        task._given_probes = list(probes)
        task._probes = task._proj = None
        return task

    def probe_tensors(self) -> Any:
        """The probe set as model inputs."""
        return self.collate_probes(self.probe_bytes())

    def collate_probes(self, probes: list[bytes]) -> Any:
        """Probe inputs (canonical bytes) as model inputs."""
        return self.collate(probes)

    def probe_hash(self) -> bytes:
        """Commitment to the probe set."""
        return sha256(canonical_json([p.hex() for p in self.probe_bytes()]))

    def probe_outputs(self, model: nn.Module, probes: Any) -> torch.Tensor:
        """The model's outputs ``[P, ..., width]`` on the probe inputs."""
        raise NotImplementedError

    def probe_losses(self, outputs: torch.Tensor, probes: Any) -> torch.Tensor:
        """Per-probe losses ``[P]`` computed from the outputs alone (so a black box can be scored)."""
        raise NotImplementedError

    def fingerprint_of_outputs(self, outputs: torch.Tensor) -> Fingerprint:
        """The fingerprint of probe outputs, however they were obtained (a model, or an endpoint)."""
        if self._probes is None:
            self._probes = self.probe_tensors()
        count = len(self.probe_bytes())
        # a layout other than [probes, ..., width] would record fingerprints every audit then refuses: said here,
        # where the run records its first one
        if outputs.dim() < 2 or outputs.shape[0] != count:
            raise ValueError(f"task {self.name!r}: its outputs on its {count} probes have the shape "
                             f"{list(outputs.shape)}; a fingerprint takes them as [probes, ..., width], the probes "
                             "on the first axis (its predict or probe_outputs returns another layout)")
        losses = self.probe_losses(outputs, self._probes)
        if tuple(losses.shape) != (count,):
            raise ValueError(f"task {self.name!r}: its probe losses have the shape {list(losses.shape)}, not one "
                             f"number for each of its {count} probes (its example_losses or probe_losses)")
        if self._proj is None:
            self._proj = projection_matrix(self.probe_hash(), outputs.shape[-1], self.config.fingerprint_dims)
        return fingerprint_from_outputs(outputs, losses, self._proj)

    # --- evaluation ---------------------------------------------------------------------
    def eval_dataset(self) -> Dataset:
        """The committed evaluation split (never in the training order)."""
        raise NotImplementedError

    hides_targets = False  # whether ``hidden`` and ``score`` let a contest track score a method blind

    def sample_tokens(self, sample: bytes) -> int:
        """The tokens a training sample counts for against a contest's budget (its bytes, unless the task says)."""
        return len(sample)

    def hidden(self, sample: bytes) -> bytes:
        """An evaluation sample without its target (what a submitted method is shown when it is scored)."""
        raise NotImplementedError(f"task {getattr(self, 'name', '?')!r} cannot hide its targets")

    def score(self, outputs: torch.Tensor, sample: bytes) -> dict:
        """A per-example result (as ``eval_example``'s) from a method's outputs on ``hidden(sample)``."""
        raise NotImplementedError(f"task {getattr(self, 'name', '?')!r} cannot score outputs")

    def eval_example(self, model: nn.Module, sample: bytes) -> dict:
        """Per-example result: ``loss``, and for classifiers ``prediction`` and ``correct``."""
        raise NotImplementedError

    def aggregates(self, examples: list[dict]) -> dict:
        """Aggregate metrics, recomputable exactly from the per-example results."""
        n = len(examples)
        mean = math.fsum(e["loss"] for e in examples) / n if n else 0.0
        out = {"examples": n, "mean_loss": mean}
        if examples and "correct" in examples[0]:
            out["accuracy"] = sum(1 for e in examples if e["correct"]) / n
        return out

    @torch.no_grad()
    def fingerprint(self, model: nn.Module) -> Fingerprint:
        """The behavioral fingerprint of ``model``: its outputs on the probes in eval mode.

        Witnessing must not change the training: in eval mode BatchNorm reads its running
        statistics instead of updating them, and no gradient is taken, so the probes leave every
        parameter, buffer and optimizer state as they were. Each module's own mode is restored.
        """
        if self._probes is None:
            self._probes = self.probe_tensors()
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            return self.fingerprint_of_outputs(self.recorded_probe_outputs(model, self._probes))
        finally:
            for m, training in modes:
                m.training = training

    def fingerprint_spec(self) -> dict:
        """What the fingerprint contains, for the manifest."""
        return {
            "probes": len(self.probe_bytes()),
            "projection_dims": self.config.fingerprint_dims,
            "sketch_dims": self.config.sketch_dims,
            "digest": "sha256(float32 probe outputs)",
        }

