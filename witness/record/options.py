"""The recorder's options: what ``Recorder.create`` and ``Recorder.resume`` take besides the task,
the bundle's folder, the signing key and ``r``, grouped by what they decide. Each is a frozen
dataclass whose fields all have defaults and which checks itself where it is built (the shape of
torchtitan's config dataclasses)::

    rec = Recorder.create(task, "run/", key, r=os.urandom(32),
                          commit=Commitments(checkpoint_every=50, state_every=1),
                          training=Training(model=model, optimizer=optimizer, threads=4),
                          online=Online(beacon=BeaconClient(url)),
                          self_check=SelfChecking(share=0.01))

* ``Commitments``: what the manifest commits the run to: how often a state is committed and
  written whole, whether the dataset's leaves travel with the bundle, who chose ``r``.
* ``Training``: what is trained and where: the loop's own model and optimizer, the device, torch's
  thread count; a torchrun run's session, initial state, parallelism and digest shards (which
  ``witness.distributed`` fills in).
* ``Online``: where each signed head goes while the run trains: a callback (a leaderboard's
  streamer), and a beacon for online challenges with their settings.
* ``SelfChecking``: the record-time self-check, and the share of the loop's time its background
  checker may spend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead
from .link import BeaconLink, OnlineSpec

if TYPE_CHECKING:
    import torch

    from ..session import TrainingSession

DEFAULT_SHARE = 0.01  # of the loop's step time: what the background check may cost

HeadCallback = Callable[[SignedTreeHead, RunLog], None]


@dataclass(frozen=True)
class Commitments:
    """What the run commits, and how often (the manifest's fields).

    ``state_every``: a record commits the hash of the whole training state after its step every
    ``state_every`` steps (1: every step; more lowers the recorder's cost, and the cheap audit then
    replays up to that many steps a challenge). ``checkpoint_every``: the state is written whole
    every ``checkpoint_every`` steps, a multiple of ``state_every`` (every checkpoint is a committed
    state). ``leaves``: write the dataset's per-sample commitments into the bundle (``dataset.leaves``,
    64 bytes a sample); without them a verifier needs the file from elsewhere (``--leaves``), which
    suits a large corpus whose leaves are published once for all its runs. ``r_source``: who chose
    ``r``: the trainer, or a leaderboard's ``"ticket"``.
    """

    checkpoint_every: int = 50
    state_every: int = 1
    leaves: bool = True
    r_source: str = "trainer"

    def __post_init__(self) -> None:
        if self.state_every < 1 or self.checkpoint_every < 1 or self.checkpoint_every % self.state_every:
            raise ValueError("checkpoint_every must be a multiple of state_every (every checkpoint is a committed state)")


@dataclass(frozen=True)
class Training:
    """What is trained, and where.

    ``model`` and ``optimizer``: the loop's own (``witness.record.loop``). The model is given, in
    place, the initial state the task builds from the run seed (what a verifier rebuilds), and the
    optimizer is checked against the recipe's (by default the recipe's is built on the loop's
    model); then ``rec.batches(get_batch)`` hands the loop its committed batches and each step is
    recorded when ``optimizer.step()`` returns. A single-process run only. ``device``: where the
    session's model trains (by default the loop's model's device, else the CPU), with deterministic
    kernels. ``threads``: torch's thread count (at most the machine's cores), which the manifest
    records and replay runs at.

    A torchrun run (``witness.distributed`` fills these in): its own ``session`` (the wrapped
    model), the ``init_state`` taken before wrapping, its ``parallelism`` (``"ddp"``, ``"fsdp"``),
    and for FSDP2 over several ranks the number of row ``shards`` its state digest splits tensors
    into (one per rank).
    """

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    device: str | torch.device = "cpu"
    threads: int | None = None
    session: TrainingSession | None = None
    init_state: dict | None = None
    parallelism: str = "none"
    shards: int = 1

    def __post_init__(self) -> None:
        if self.model is not None and (self.session is not None or self.parallelism != "none"):
            raise ValueError("the loop's own model is adopted by Recorder.create in one process, and under torchrun "
                             "by start_run (witness.distributed.loop), which builds the session itself")
        if self.optimizer is not None and self.model is None:
            raise ValueError("the loop's own optimizer comes with the model it steps (Training(model=...))")
        if self.shards < 1:
            raise ValueError(f"a state digest splits tensors into one row shard or more, not {self.shards!r}")


@dataclass(frozen=True)
class Online:
    """Where each signed head goes while the run trains.

    ``on_head``: called with every tree head as it is signed, and the log (a leaderboard's
    ``HeadStreamer``). ``beacon``: a beacon link (``witness.beacon.client.BeaconClient``, or
    witnesses and drand through ``witness.beacon.windows.WitnessedLink``) turns on online
    challenges: a head goes to it every ``spec.every`` steps, and the states its statements select
    are kept (docs/online.md). ``spec``: their settings; by default ``OnlineSpec.for_steps`` over
    the recipe's steps (a resumed run's are its manifest's). ``ring_bytes``: the most host memory
    the ring of kept states may take (by default a quarter of the host's, shared by its ranks,
    ``link.host_budget``): the ring holds as many states as fit, at most ``spec.ring``, and a budget
    that cannot hold one window's states is refused before step 0.
    """

    beacon: BeaconLink | None = None
    spec: OnlineSpec | None = None
    on_head: HeadCallback | None = None
    ring_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.spec is not None and self.beacon is None:
            raise ValueError("online challenges need a beacon")
        if self.ring_bytes is not None and self.ring_bytes < 1:
            raise ValueError(f"the ring's budget is a number of bytes, not {self.ring_bytes!r}")


@dataclass(frozen=True)
class SelfChecking:
    """The record-time self-check (``witness.record.selfcheck``).

    ``enabled``: replay step 0 and one random later step as a verifier will, right after they are
    recorded, and stop with what differs if the bits are not the same (a single-process run; it
    costs two steps and, while one is checked, a second model). Later steps are sampled and
    replayed in the background by a checker process, for at most ``share`` of the loop's step time
    (1 % by default; 0 turns the background check off); a mismatch stops the run before its next
    tree head is signed.
    """

    enabled: bool = True
    share: float = DEFAULT_SHARE

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"the self-check's share of training is a fraction in [0, 1], not {self.share!r}")


def option(value: object, kind: type, name: str) -> object:
    """``value`` if it is a ``kind``, the defaults if it is None; anything else (the boolean or the
    numbers the recorder took before its options were objects) is refused, never read as a default."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"{name}= takes a witness.record.{kind.__name__} (e.g. {kind.__name__}(...)), not "
                        f"{type(value).__name__} {value!r}")
    return value
