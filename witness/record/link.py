"""What the recorder needs of a beacon, and the online settings a manifest commits.

``OnlineSpec`` is the manifest's ``online`` field (selection probability, head cadence, ring size,
the drand chain of a witnessed run, the parameter chunks each window opens); ``BeaconLink`` is the
protocol a beacon client follows (``witness.beacon.client.BeaconClient``, a witnessed link). The
recorder's ``Online`` option (``witness.record.options``) names both; ``witness.record.online``
answers the beacon's statements as the run trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Protocol

from ..commit.beacon import BeaconStatement, p_needed
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead
from ..fingerprint.chunks import DEFAULT_CHUNK_BYTES

DEFAULT_EVERY = 10
# chunks each window opens of every state (0: the run commits no chunks). Two of 1 KiB: what k chunks
# catch depends on the bytes opened (k x chunk), and each chunk also costs its path (32 bytes a level),
# so two of 1 KiB open as much as four of 512 bytes in fewer bytes; a swap moves every chunk past the
# bound (bench/swap_detection.py), so one would catch it; and the openings stay within a fifth of an
# online bundle's bytes (docs/benchmarks.md)
DEFAULT_CHUNKS = 2
DEFAULT_CONFIDENCE, DEFAULT_BAD_FRACTION = 0.99, 0.05
DRAND_EVERY = 100  # a witnessed run's default head cadence (see OnlineSpec.for_steps)
DRAND_RING = 256  # states a witnessed run holds while its rounds come (see OnlineSpec.for_steps)


class BeaconLink(Protocol):
    """What the recorder needs of a beacon (``witness.beacon.client.BeaconClient`` is one)."""

    public_key: str

    def body(self, head: SignedTreeHead, log: RunLog) -> dict:
        """The request for a head (built on the training thread, sent later in order)."""

    def post(self, body: dict, head: SignedTreeHead, log: RunLog) -> BeaconStatement:
        """Send a request; the beacon's checked statement for its head."""

    def statements(self, log: RunLog) -> list[BeaconStatement]:
        """Every statement the beacon holds for the run."""

    def check(self, obj: object, log: RunLog) -> BeaconStatement:
        """A statement of this beacon for the run, parsed and its signature checked."""

    # A link may also have ``publish(kind, step, path)``: each file kept for a selected step is
    # passed to it once written (a leaderboard replays the step while the run trains).


@dataclass(frozen=True)
class OnlineSpec:
    """The manifest's online settings: selection probability, head cadence, ring size."""

    p: float
    every: int = DEFAULT_EVERY
    ring: int = 2 * DEFAULT_EVERY + 1
    drand: str | None = None  # the drand chain's hash (hex) of a run whose windows witnesses cosign
    # the parameter chunks each window opens of every state, and their size (chunks 0: none committed)
    chunks: int = DEFAULT_CHUNKS
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # "blake3": the chunks open into the state hash's own BLAKE3 trees (manifest version 4, where the run
    # can: one process, 1 KiB chunks, BLAKE3 digests; witness.bundle.opened); None: into a param_root of
    # their own (version 3, as recorded before). And where the states were hashed ("host" or "cuda")
    tree: str | None = "blake3"
    hashed_by: str = "host"

    @classmethod
    def for_steps(cls, steps: int, every: int | None = None, p: float | None = None,
                  ring: int | None = None, drand: str | None = None, chunks: int | None = None) -> OnlineSpec:
        """Settings whose bound reaches 99 % against 5 % bad steps over ``steps`` steps (unless p is given).

        A head every ``DEFAULT_EVERY`` steps by default; a witnessed run's (``drand``) every
        ``DRAND_EVERY``: each head costs two witnesses' requests and checks, and a window's round
        comes seconds after it closes however short it is, so short windows buy nothing there
        (bench/online_cost.py: at 10 steps a window, the heads cost the trainer more than the ring)."""
        if every is None:
            every = DRAND_EVERY if drand else DEFAULT_EVERY
        every = max(1, min(every, steps))
        if p is None:
            p = min(1.0, p_needed(DEFAULT_CONFIDENCE, DEFAULT_BAD_FRACTION, steps) * (1 + 1e-9))
        if ring is None:
            # a drand round comes 4 to 8 s after its window closed: the ring holds the states trained
            # meanwhile (DRAND_RING of them unless told; a slower step needs fewer)
            ring = max(2 * every + 1, DRAND_RING) if drand else 2 * every + 1
        return cls(float(p), every, ring, drand, DEFAULT_CHUNKS if chunks is None else chunks)

    def to_json(self) -> dict:
        """The manifest's ``online`` field."""
        return {"p": self.p, "every": self.every, "ring": self.ring} | ({"drand": self.drand} if self.drand else {}) \
            | ({"chunks": self.chunks, "chunk_bytes": self.chunk_bytes} if self.chunks else {}) \
            | ({"tree": self.tree, "hashed_by": self.hashed_by} if self.chunks and self.tree else {})


def host_budget() -> int:
    """The default budget of one rank's ring, in bytes: a quarter of the host's memory, shared by the
    ranks on the host (torchrun's ``LOCAL_WORLD_SIZE``). The whole of it is taken only while the
    beacon is slower than training; a state the ring has no room for waits for the beacon."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return total // 4 // max(1, ranks)


def ring_within(spec: OnlineSpec, state_bytes: int, budget: int) -> OnlineSpec:
    """``spec`` with its ring cut to the states that fit ``budget`` bytes (a state is ``state_bytes``).

    A window needs ``every + 1`` states held at once (its first to its last), so a budget that
    cannot hold that many is refused here, before step 0, with the figures and the ways out."""
    fits = budget // max(1, state_bytes)
    if fits <= spec.every:
        need = (spec.every + 1) * state_bytes
        raise ValueError(
            f"the online ring cannot hold one window: a state is {state_bytes / 2**20:,.1f} MiB, a window of "
            f"{spec.every} step(s) holds {spec.every + 1} states ({need / 2**30:,.2f} GiB), and the ring's budget is "
            f"{budget / 2**30:,.2f} GiB ({fits} state(s)). Give a shorter window (--online-every, OnlineSpec(every="
            f"...); at most {max(fits - 1, 0)} step(s) fit), more ranks (each holds its share), a larger budget "
            "(Online(ring_bytes=...)), or train without online challenges and take the offline or cheap audit")
    return replace(spec, ring=min(spec.ring, fits))
