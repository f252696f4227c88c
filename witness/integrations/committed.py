"""What every integration feeds a framework's loop: the committed data order, as a sampler
over the task's canonical samples (the task collates them, exactly as replay does)."""

from __future__ import annotations

from typing import Any

import torch


class CommittedOrder(torch.utils.data.Sampler):
    """The recorder's committed data order, step after step: what the sampler must yield."""

    def __init__(self, rec: Any):
        self.rec = rec

    def __len__(self) -> int:
        return self.rec.task.config.steps * self.rec.task.config.batch_size

    def __iter__(self):
        for t in range(self.rec.task.config.steps):
            yield from self.rec.session.batch_indices(t)


class CommittedDataset(torch.utils.data.Dataset):
    """The task's training set as canonical sample bytes (the collator is the task's)."""

    def __init__(self, rec: Any):
        self.data = rec.task.dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> bytes:
        return self.data.sample_bytes(index)


def committed_dataset(rec: Any) -> CommittedDataset:
    """The training set to give the ``Trainer``."""
    return CommittedDataset(rec)
