"""A witness's signed count of a run's other attempts: the text of its ``attempts`` note.

A witness (``witness beacon serve``) links the runs it sees. It signs, for a run's origin, how many
other runs it linked to it (``others``: the same key, recipe or run seed) and how many of those it
prices in as attempts at it (``attempts``: every run of the same run seed). Version 2 also lists
the priced runs by their ids, so that a verifier holding several witnesses' notes counts each
attempt once, whichever of them saw it (the largest count alone undercounts attempts that
different witnesses saw; the sum of the counts overcounts those that several saw).

    witness attempts/v2
    <origin>
    <the latest size the witness cosigned for it>
    others N
    attempts M
    run <hex id>          (M lines, sorted, when M <= MAX_LISTED; none when more)

Version 1 (witness 0.6 and 0.7) has no ``run`` lines, and priced only the runs of the same seed *and*
recipe (a recipe field that changes no bit of the training escaped it): a verifier parses it, but
reads the attempts it counts as unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import MalformedInput

ATTEMPTS_V1 = "witness attempts/v1"
ATTEMPTS_V2 = "witness attempts/v2"
# Past this many, a note counts its attempts without naming them (a trainer with that many restarts
# has a bound near 0 anyway, and the note stays within a signed note's 64 KiB).
MAX_LISTED = 256
_COUNT = r"(?:0|[1-9][0-9]{0,17})"  # ASCII digits, no sign or leading zero (int() takes "+1", " 1", "1_0")
_NOTE = re.compile(r"(?P<header>witness attempts/v[12])\n(?P<origin>[^\n]+)\n(?P<size>" + _COUNT + r")\nothers (?P<others>"
                   + _COUNT + r")\nattempts (?P<attempts>" + _COUNT + r")\n(?P<runs>(?:run [0-9a-f]{64}\n)*)")


@dataclass(frozen=True)
class AttemptsNote:
    """What one witness signed about one origin's other attempts."""

    origin: str
    size: int
    others: int
    attempts: int
    # the priced runs' ids (64 hex digits each, sorted); None where the note only counts them
    runs: tuple[str, ...] | None = None
    version: int = 2  # 1: counted under the old rule (the same seed and recipe), which a verifier cannot use

    def text(self) -> str:
        """The note's text (version 2): the runs listed when there are at most ``MAX_LISTED``."""
        listed = self.runs if self.runs is not None and len(self.runs) <= MAX_LISTED else ()
        return (f"{ATTEMPTS_V2}\n{self.origin}\n{self.size}\nothers {self.others}\nattempts {self.attempts}\n"
                + "".join(f"run {r}\n" for r in sorted(listed)))

    @classmethod
    def parse(cls, text: str) -> AttemptsNote:
        """A note's text, strictly: either version; a version 2 note lists exactly its attempts (sorted,
        each once) when they are at most ``MAX_LISTED``, and none when more."""
        found = _NOTE.fullmatch(text) if isinstance(text, str) else None
        if found is None:
            raise MalformedInput(f"not a {ATTEMPTS_V2} (or v1) note")
        attempts = int(found["attempts"])
        runs = tuple(line[4:] for line in found["runs"].splitlines())
        if found["header"] == ATTEMPTS_V1:
            if runs:
                raise MalformedInput(f"a {ATTEMPTS_V1} note lists no runs")
            return cls(found["origin"], int(found["size"]), int(found["others"]), attempts, version=1)
        want = attempts if attempts <= MAX_LISTED else 0
        if len(runs) != want or list(runs) != sorted(set(runs)):
            raise MalformedInput(f"an attempts note counting {attempts} attempt(s) lists {len(runs)} run(s): it lists "
                                 f"each priced run once, in order, when they are at most {MAX_LISTED}")
        return cls(found["origin"], int(found["size"]), int(found["others"]), attempts,
                   runs if attempts <= MAX_LISTED else None)


def count_attempts(notes: list[AttemptsNote], run: str) -> int:
    """The distinct attempts other than ``run`` that any of ``notes`` prices in: the union of the runs
    they name, plus the count of every note that names none (over 256: counted as if no two saw the same)."""
    named: set[str] = set()
    unnamed = 0
    for n in notes:
        if n.runs is None:
            unnamed += n.attempts
        else:
            named.update(n.runs)
    named.discard(run)
    return len(named) + unnamed
