"""The verifier's three inputs besides the bundle: what it trusts, what it asks, where evidence comes from.

None of them is ever read from the bundle: a trainer holds its own key and can sign anything, so
how strictly a run is checked, and against whom, is the verifier's choice alone (``Verifier``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..commit.signing import parse_public_key
from ..errors import MalformedInput

if TYPE_CHECKING:  # a Response reads tensors: imported where an audit needs one
    from ..commit.signing import SignedTreeHead
    from ..data.dataset import Dataset
    from ..methods.wheel import MethodWheel
    from .online import WitnessTrust
    from .response import Response

DEFAULT_CONFIDENCE = 0.99
DEFAULT_BAD_FRACTION = 0.05
MODES = ("offline", "interactive", "online")


@dataclass(frozen=True)
class Trust:
    """What the verifier trusts, each named by the verifier (a flag, a leaderboard's own records).

    ``signer``: the trainer's public key (hex or PEM text); without it the bundle's own key is taken, and
    the verdict says whose signature it checked. ``beacon_key`` (one beacon, hex) or ``witnesses``
    (named witnesses and a drand chain) are whom online challenges are trusted from. The log must
    extend every one of the ``published_heads`` (heads the trainer published earlier: it cannot have
    been rewritten since). ``ticket`` is the r a ticket issuer handed out, and ``data_root`` the root
    the run must have trained on. ``method``: a submitted method's wheel (``methods.wheel``), the code
    the run must have been trained with; its steps are then replayed only in the sandbox. ``dataset``:
    the training data the verifier holds (a leaderboard's track's), which an offline audit replays from
    instead of the data the task names (a submitted method names none the verifier would read).
    """

    signer: str | None = None
    beacon_key: str | None = None
    witnesses: WitnessTrust | None = None
    published_heads: Sequence[SignedTreeHead] = ()
    ticket: bytes | None = None
    data_root: bytes | None = None
    method: MethodWheel | None = None
    dataset: Dataset | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "published_heads", tuple(self.published_heads))
        for name in ("signer", "beacon_key"):  # PEM or hex in either case: the raw hex the bundle names keys by
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, parse_public_key(value) if value.lstrip().startswith("-----BEGIN")
                                   else value.strip().lower())
        if self.beacon_key is not None and self.witnesses is not None:
            raise MalformedInput("online mode trusts one beacon (--beacon-key) or witnesses and drand (--witness, "
                                 "--drand), not both")

    @property
    def online(self) -> str | WitnessTrust | None:
        """Whom online challenges are trusted from: the beacon's key, the witnesses, or None."""
        return self.beacon_key if self.beacon_key is not None else self.witnesses


@dataclass(frozen=True)
class Policy:
    """What the verifier asks: how it audits, and how hard.

    ``mode``: ``offline`` (replay from checkpoints, the data here), ``interactive`` (the trainer's
    response to challenges drawn from the head and ``nonce``) or ``online`` (the steps a trusted
    beacon or witnesses selected while the run trained). ``challenges`` replay challenges of
    ``length`` steps, by default as many as ``confidence`` against a ``bad_fraction`` of bad steps
    needs. Replay is bit-exact unless ``exact`` is False (other hardware: within ``thresholds``).
    ``threads`` defaults to the run's recorded count, bounded to this machine's cores.
    """

    mode: str = "offline"
    challenges: int | None = None
    confidence: float | None = None
    bad_fraction: float | None = None
    length: int = 1
    exact: bool = True
    thresholds: Mapping[str, float] = field(default_factory=dict)
    threads: int | None = None
    device: str = "cpu"
    nonce: bytes | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise MalformedInput(f"unknown mode {self.mode!r}")
        if self.length < 1 or (self.challenges is not None and self.challenges < 1):
            raise MalformedInput("need at least one challenge of at least one step")
        from .replay import check_thresholds  # replay imports torch

        check_thresholds(dict(self.thresholds))
        object.__setattr__(self, "thresholds", MappingProxyType(dict(self.thresholds)))

    @property
    def fraction(self) -> float:
        """The fraction of bad steps the bound is computed against."""
        return DEFAULT_BAD_FRACTION if self.bad_fraction is None else self.bad_fraction

    def drawn(self) -> int:
        """How many replay challenges to draw: those asked for, or enough for the confidence."""
        from .challenges import challenges_needed

        return self.challenges or challenges_needed(self.confidence or DEFAULT_CONFIDENCE, self.fraction)


@dataclass(frozen=True)
class Evidence:
    """Where the evidence the bundle does not carry comes from.

    ``response``: the trainer's answer to interactive challenges (``witness respond``; a folder, or
    a ``Response`` already read). ``leaves``: the dataset's leaves file where the bundle carries
    none (a large corpus's, published once): every batch root is checked against it in full.
    """

    response: str | os.PathLike | Response | None = None
    leaves: str | os.PathLike | None = None
