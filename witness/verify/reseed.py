"""Whether another run seed is another computation, as the online bound's pricing of restarts assumes.

A beacon or a witness prices every run of one run seed as an attempt; a draw it cannot see needs
another seed, and so (for the pricing to cost the trainer anything) other initial weights, another
data order or other randomness inside the steps (dropout). All three are functions of the seed in
every task witness builds, but a task may start from fixed weights (a fine-tune whose model ignores
the seed), take the whole dataset as every batch and draw nothing at random: then a run under any
seed trains the same steps, and each fresh seed is a free draw. The verifier checks what it can see
cheaply, for the task it runs: the first batches as sets of samples, the initial state under a
second seed, and whether a step's loss on the probes changes with the step's seed.
"""

from __future__ import annotations

import torch

from ..bundle.schema import Manifest
from ..bundle.state import state_hash
from ..commit.hashing import same, tagged_hash
from ..data.order import batch_indices, step_seed
from ..task.base import Task

BATCHES_COMPARED = 8
# Past this many samples, a batch smaller than the dataset is another set of samples under another
# seed but for a vanishing chance; the permutations are then not drawn (2 s a million samples).
EXACT_UP_TO = 4096


def reseeded_same(task: Task, m: Manifest, steps: int, init: dict[str, torch.Tensor]) -> str | None:
    """Why a run of this recipe under another run seed may be this very computation (the same initial
    state, ``init`` here, the same samples in its first batches and no randomness a step draws from
    its seed), or None where it is not."""
    from ..methods.remote import RemoteSession, open_session

    size = task.config.batch_size
    if size < m.dataset_size and m.dataset_size > EXACT_UP_TO:
        return None
    other = tagged_hash("witness/another-seed/v1", m.run_seed)
    for t in range(min(steps, BATCHES_COMPARED)):
        if sorted(batch_indices(m.run_seed, t, size, m.dataset_size)) != \
                sorted(batch_indices(other, t, size, m.dataset_size)):
            return None  # another seed trains on other samples
    session = open_session(task, other, m.dataset_size, m.world_size, m.parallelism, "cpu")
    if not same(state_hash(session.state(), m.state_digest),
                state_hash(init, m.state_digest)):
        return None  # another seed starts from other weights
    random = None if isinstance(session, RemoteSession) else _draws_from_its_seed(task, session.model, (step_seed(m.run_seed, 0), step_seed(other, 0)))
    if random:
        return None  # another seed draws other dropout masks: other steps
    unknown = "" if random is False else " (whether a step draws from its seed could not be tried on the probes)"
    return ("the task's initial state does not depend on the run seed (fixed starting weights), every batch holds the "
            "same samples under another seed (the whole dataset) and a step draws nothing from its seed"
            f"{unknown}, so a run under another seed may train these very steps: restarts are not priced, and the "
            "online bound is 0 (add an after-the-fact audit)")


def _draws_from_its_seed(task: Task, model: torch.nn.Module, seeds: tuple[int, int]) -> bool | None:
    """Whether a training step's loss on the probes (training samples, for such a task) differs under
    two step seeds (dropout, say); None where the probes are not samples a step can take."""
    if not task.probes_are_samples:
        return None
    try:
        batch = task.collate(task.probe_bytes())
        model.train()  # a throwaway model: its buffers (BatchNorm's) may change here
        with torch.no_grad():
            a, b = (task.step_loss(model, batch, s).detach().cpu().numpy().tobytes() for s in seeds)
    except Exception:  # noqa: BLE001 - whatever the task's own code raised: not tried
        return None
    return a != b
