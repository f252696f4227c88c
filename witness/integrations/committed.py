"""What every integration feeds a framework's loop: the committed data order, as a sampler
over the task's canonical samples (the task collates them, exactly as replay does)."""

from __future__ import annotations

from typing import Any

import torch


class CommittedOrder(torch.utils.data.Sampler):
    """The recorder's committed data order, step after step: what the sampler must yield.

    Under torchrun (``rec.ranks``: rank, world) a framework's loader deals the sampler's batches of
    ``part`` samples to the ranks in turn (accelerate's ``BatchSamplerShard``), while rank ``r``
    trains parts ``r·G/W … (r+1)·G/W − 1`` of each step's G (``witness.task.ranks``): the parts are
    yielded in the order that deals each rank its own, in order."""

    def __init__(self, rec: Any, part: int = 0):  # noqa: ANN401 - a recorder
        self.rec, self.part = rec, part

    def __len__(self) -> int:
        return self.rec.task.config.steps * self.rec.task.config.batch_size

    def __iter__(self):
        world = getattr(self.rec, "ranks", (0, 1))[1]
        for t in range(self.rec.task.config.steps):
            idx = self.rec.session.batch_indices(t)
            if world == 1:
                yield from idx
                continue
            parts = [idx[i:i + self.part] for i in range(0, len(idx), self.part)]
            local = len(parts) // world
            for k in range(local):
                for r in range(world):
                    yield from parts[r * local + k]


class CommittedDataset(torch.utils.data.Dataset):
    """The task's training set as canonical sample bytes (the collator is the task's)."""

    def __init__(self, rec: Any):
        self.data = rec.task.dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> bytes:
        return self.data.sample_bytes(index)


def same_batch(got: Any, want: Any) -> bool:
    """Whether a framework's batch is the committed one (tensors, or dicts, tuples, lists of them)."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_batch(got[k], want[k]) for k in want)
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(same_batch, got, want))
    return got == want


def committed_dataset(rec: Any) -> CommittedDataset:
    """The training set to give the ``Trainer``."""
    return CommittedDataset(rec)


def check_same_dataset(rec: Any, dataset: Any) -> None:  # noqa: ANN401 - the framework's dataset
    """Refuse a framework's own dataset unless its samples, coded as the task codes them, are the
    committed ones (the same root): the loop's data is then the data a verifier rebuilds."""
    task = rec.task
    if not hasattr(task, "_as_dataset"):
        raise ValueError(f"the task {task.name!r} builds its own data: give the framework committed_dataset(rec)")
    try:
        mine = task._as_dataset(dataset, "train")
        root = mine.commitment_root(rec.manifest.get("data_commitment", 1))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"the loop's dataset cannot be coded as the task {task.name!r} codes its samples ({e}): "
                         "its samples must be what the plugin's make_dataset gives (tensors: a datasets.Dataset "
                         "gives lists unless .with_format('torch'))") from None
    if len(mine) != rec.manifest["dataset_size"] or root.hex() != rec.manifest["data_root"]:
        raise ValueError(f"the loop's dataset ({len(mine)} samples, root {root.hex()[:16]}…) is not the task's "
                         f"({rec.manifest['dataset_size']} samples, root {rec.manifest['data_root'][:16]}…): the "
                         "plugin's make_dataset must build the samples the script trains on")
