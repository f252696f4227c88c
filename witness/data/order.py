"""The data order derived from the run seed, so the trainer cannot choose it."""

from __future__ import annotations

from functools import lru_cache

from ..commit.hashing import tagged_hash

ORDER_TAG = "witness/order/v1"


@lru_cache(maxsize=4)
def epoch_permutation(seed: bytes, epoch: int, n: int) -> tuple[int, ...]:
    """Permutation of range(n) for one epoch: indices sorted by H(seed, epoch, index)."""
    e = epoch.to_bytes(8, "big")
    return tuple(sorted(range(n), key=lambda i: tagged_hash(ORDER_TAG, seed, e, i.to_bytes(8, "big"))))


def batch_indices(seed: bytes, step: int, batch_size: int, n: int) -> list[int]:
    """Dataset indices of the batch at ``step``: consecutive slices through the epochs."""
    if n <= 0 or batch_size <= 0:
        raise ValueError("empty dataset or batch")
    out = []
    for p in range(step * batch_size, (step + 1) * batch_size):
        out.append(epoch_permutation(seed, p // n, n)[p % n])
    return out


def derive_run_seed(data_root: bytes, r: bytes) -> bytes:
    """The run seed H(data root || r) (Choi, Shavit & Duvenaud 2023): bound to the data."""
    return tagged_hash("witness/run-seed/v1", data_root, r)


def step_seed(run_seed: bytes, step: int, micro: int = 0) -> int:
    """A 63-bit seed for the randomness inside one step (dropout), so any step replays alone.

    Micro-batch ``r`` of a distributed step (rank ``r``'s share) has its own seed; micro-batch 0
    has the single-process seed.
    """
    parts = [run_seed, step.to_bytes(8, "big")] + ([micro.to_bytes(8, "big")] if micro else [])
    return int.from_bytes(tagged_hash("witness/step-seed/v1", *parts)[:8], "big") >> 1
