"""Replay challenges drawn from H(tree head || verifier nonce), and the detection bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..commit.hashing import canonical_json, tagged_hash
from ..commit.signing import SignedTreeHead


def percent_down(p: float, digits: int = 2) -> str:
    """A probability as a percentage rounded down (a bound shown rounded up would claim more than
    was checked: 0.99996 is "99.99", never "100.00")."""
    scale = 10 ** digits
    return f"{math.floor(100 * p * scale * (1 + 1e-12)) / scale:.{digits}f}"


@dataclass(frozen=True, order=True)
class ReplayChallenge:
    """Re-run steps ``step .. step + length - 1`` and compare with their records."""

    step: int
    length: int


def challenge_seed(head: SignedTreeHead, nonce: bytes) -> bytes:
    """The challenge randomness: fixed only once the head is signed and the nonce is known."""
    return tagged_hash("witness/challenge/v1", canonical_json(head.to_json()), nonce)


def _uniform(seed: bytes, counter: int, bound: int) -> int:
    """An unbiased integer in [0, bound) from SHA-256 in counter mode (rejection sampling)."""
    limit = (1 << 256) - (1 << 256) % bound
    j = 0
    while True:
        x = int.from_bytes(tagged_hash("witness/challenge-draw/v1", seed, counter.to_bytes(8, "big"), j.to_bytes(4, "big")), "big")
        if x < limit:
            return x % bound
        j += 1


def sample_indices(seed: bytes, n: int, count: int) -> list[int]:
    """``count`` distinct indices of ``range(n)``, uniform, sorted (all of them if count >= n)."""
    pool = list(range(n))
    k = min(count, n)
    for i in range(k):  # partial Fisher-Yates: sampling without replacement
        j = i + _uniform(seed, i, n - i)
        pool[i], pool[j] = pool[j], pool[i]
    return sorted(pool[:k])


def draw_challenges(head: SignedTreeHead, nonce: bytes, steps: int, count: int, length: int = 1) -> list[ReplayChallenge]:
    """``count`` distinct challenge steps, uniform over the run (all steps if count >= steps)."""
    if steps < 1 or count < 1 or length < 1:
        raise ValueError("need at least one step, one challenge and a positive length")
    picked = sample_indices(challenge_seed(head, nonce), steps, count)
    return [ReplayChallenge(t, min(length, steps - t)) for t in picked]


def detection_probability(bad_fraction: float, challenges: int, steps: int | None = None) -> float:
    """Lower bound 1 - (1 - f)^q on catching a run with a fraction f of bad steps (1 if all were replayed).

    Challenges are distinct steps, so when ``steps`` is given and q covers all of them every
    step was replayed and no bad step can have been missed.
    """
    if steps is not None and steps > 0 and challenges >= steps:
        return 1.0
    return 1.0 - (1.0 - bad_fraction) ** challenges


MAX_CHALLENGES = 10**9
WEAK_BOUND = 0.90  # below this, an accepted audit says it is weak, whatever the user asked for


def weak_bound_warning(probability: float, bad_fraction: float, wanted: float | None = None,
                       flag: str = "--challenges", bad: str = "bad steps") -> str | None:
    """A warning line when the detection bound is below the confidence asked for (or 90 %), else None."""
    floor = WEAK_BOUND if wanted is None else wanted
    if probability >= floor:
        return None
    need = challenges_needed(floor, bad_fraction)
    return (f"WARNING: weak audit: the bound {percent_down(probability)}% is below the {100 * floor:g}% "
            f"{'asked for' if wanted is not None else 'that a meaningful audit needs'}, so a run with "
            f"{100 * bad_fraction:g}% {bad} could well pass it; ask for {flag} {need} or more")


def challenges_needed(confidence: float, bad_fraction: float) -> int:
    """The smallest q with 1 - (1 - f)^q >= confidence."""
    if not 0 < confidence < 1 or not 0 < bad_fraction < 1:
        raise ValueError("confidence and bad fraction must lie strictly between 0 and 1")
    per = -math.log1p(-bad_fraction)  # exact for tiny f, where log(1 - f) rounds to 0
    q = -math.log1p(-confidence) / per if per > 0 else math.inf
    if q > MAX_CHALLENGES:
        raise ValueError(f"detecting a bad fraction of {bad_fraction:.3g} with confidence {confidence} takes more than "
                         f"{MAX_CHALLENGES} challenges; ask for a larger bad fraction (or replay every step)")
    return max(1, math.ceil(q - 1e-12))
