"""Whether another run seed is another computation, as the online bound's pricing of restarts assumes.

A beacon or a witness prices every run of one run seed as an attempt; a draw it cannot see needs
another seed, and so (for the pricing to cost the trainer anything) other initial weights or another
data order. Both are functions of the seed in every task witness builds, but a task may start from
fixed weights (a fine-tune whose model ignores the seed) and take the whole dataset as every batch:
then a run under any seed trains the same steps, and each fresh seed is a free draw. The verifier
checks the two things it can see cheaply, for the task it runs: the initial state under a second
seed, and the first batches as sets of samples.
"""

from __future__ import annotations

import torch

from ..bundle.schema import Manifest
from ..bundle.state import state_hash
from ..commit.hashing import same, tagged_hash
from ..data.order import batch_indices
from ..task.base import Task

BATCHES_COMPARED = 8


def reseeded_same(task: Task, m: Manifest, steps: int, init: dict[str, torch.Tensor]) -> str | None:
    """Why a run of this recipe under another run seed may be this very computation (the same initial
    state, ``init`` here, and the same samples in its first batches), or None where it is not."""
    from ..bundle.state import state_tensors
    from ..session import TrainingSession

    other = tagged_hash("witness/another-seed/v1", m.run_seed)
    for t in range(min(steps, BATCHES_COMPARED)):
        size = task.config.batch_size
        if sorted(batch_indices(m.run_seed, t, size, m.dataset_size)) != \
                sorted(batch_indices(other, t, size, m.dataset_size)):
            return None  # another seed trains on other samples
    session = TrainingSession(task, other, m.dataset_size, m.world_size, m.parallelism, "cpu")
    theirs = state_tensors(session.model, session.optimizer)
    if not same(state_hash(theirs, m.state_digest), state_hash(init, m.state_digest)):
        return None  # another seed starts from other weights
    return ("the task's initial state does not depend on the run seed (fixed starting weights) and every batch holds "
            "the same samples under another seed (the whole dataset), so a run under another seed may train these "
            "very steps: restarts are not priced, and the online bound is 0 (add an after-the-fact audit)")
