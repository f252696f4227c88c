"""The ledger of steps actually replayed, and the only place a verdict's bound comes from.

Each entry is evidence for one step: replay started from a committed state whose hash was checked,
went through the step, and ended on a committed state that was compared (its hash in exact mode,
the whole state within thresholds in tolerance mode). A challenge counts towards the bound only
when every step it names has an entry; the challenge count, the plan and the drawn steps never do
on their own. So a challenge that replayed nothing (a plan that wrapped around, a segment skipped)
cannot be passed off as checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..commit.beacon import online_bound
from ..errors import MalformedInput


@dataclass(frozen=True)
class LedgerEntry:
    """Step ``step`` replayed from the committed state after ``start`` updates (hash ``start_hash``,
    checked before replay) onto the committed state after ``end`` updates (``end_hash``, compared)."""

    step: int
    start: int
    start_hash: str
    end: int
    end_hash: str
    comparison: str  # "hash" (bit for bit) or "tolerance" (the whole state within thresholds)
    earlier: bool = False  # replayed by an earlier audit of the same commitments (a leaderboard's live round)

    def to_json(self) -> dict:
        """JSON form (in the verdict)."""
        return {"step": self.step, "start": self.start, "start_hash": self.start_hash, "end": self.end,
                "end_hash": self.end_hash, "comparison": self.comparison, "earlier": self.earlier}

    @classmethod
    def from_json(cls, obj: object) -> LedgerEntry:
        """Strictly parse the JSON form (a leaderboard keeps the entries of its live rounds)."""
        fields = {"step", "start", "start_hash", "end", "end_hash", "comparison", "earlier"}
        if not isinstance(obj, dict) or set(obj) != fields:
            raise MalformedInput("a ledger entry has exactly the fields " + ", ".join(sorted(fields)))
        if not all(type(obj[k]) is int and 0 <= obj[k] < 1 << 62 for k in ("step", "start", "end")) \
                or not obj["start"] <= obj["step"] < obj["end"]:
            raise MalformedInput("a ledger entry's steps must satisfy start <= step < end")
        if obj["comparison"] not in ("hash", "tolerance") or type(obj["earlier"]) is not bool:
            raise MalformedInput("a ledger entry's comparison is hash or tolerance, and earlier true or false")
        for k in ("start_hash", "end_hash"):
            v = obj[k]
            if not isinstance(v, str) or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
                raise MalformedInput(f"a ledger entry's {k} must be 64 lowercase hex digits")
        return cls(**obj)


def replayed(ledger: Iterable[LedgerEntry]) -> set[int]:
    """The steps the ledger holds evidence for."""
    return {e.step for e in ledger}


def verified_challenges(ledger: Iterable[LedgerEntry], challenges: Iterable[tuple[int, int]]) -> int:
    """How many of the challenges (step, length) have an entry for every step they name."""
    done = replayed(ledger)
    return sum(1 for step, length in challenges if length >= 1 and all(t in done for t in range(step, step + length)))


def drawn_bound(ledger: Sequence[LedgerEntry], challenges: Iterable[tuple[int, int]], bad_fraction: float,
                steps: int) -> float:
    """The after-the-fact bound: 1 when the ledger holds every step of the run, else 1 - (1 - f)^q
    with q the drawn challenges (uniform, distinct steps) the ledger verifies in full."""
    if steps > 0 and replayed(ledger) >= set(range(steps)):
        return 1.0
    return 1.0 - (1.0 - bad_fraction) ** verified_challenges(ledger, challenges)


def online_bound_from(ledger: Sequence[LedgerEntry], selected: Iterable[int], p: float, bad_fraction: float,
                      steps: int, uncovered: int, attempts: int | None) -> float:
    """The online bound: each bad step is selected with probability p, independently; a dishonest
    trainer puts its bad steps first where no statement looks (``uncovered`` steps) and where a
    selected step was not replayed, so b = max(0, ceil(fT) - uncovered - selected-but-not-replayed);
    one attempt escapes with (1 - p)^b, and a trainer that made ``attempts`` other attempts
    (those the beacon priced in) presents whichever escaped: the bound is (1 - (1 - p)^b)^(attempts + 1). Unknown
    attempts (no final statement counts them) give 0."""
    if attempts is None:
        return 0.0
    done = replayed(ledger)
    return online_bound(p, bad_fraction, steps, uncovered + sum(1 for t in set(selected) if t not in done), attempts)
