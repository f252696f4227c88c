"""What an online audit's verdict says about its selection and its bounded-move check, in words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .bounded import SPIKE, blind_text

if TYPE_CHECKING:
    from .bounded import MoveCheck
    from .online import OnlinePlan
    from .verdict import Verdict


def online_notes(online: OnlinePlan, skip: set[int], before: set[int], checks: list[str], notes: list[str]) -> None:
    """The checks and notes of an online selection: steps replayed earlier or not now, and steps unaudited."""
    if before & set(online.selected):
        checks.append(f"{len(before & set(online.selected))} selected step(s) replayed by an earlier audit of the "
                      "same commitments, as their states arrived")
    if skip & set(online.selected) - before:
        notes.append(f"{len(skip & set(online.selected) - before)} selected step(s) not replayed now (their "
                     "states have not arrived): the bound counts them as bad steps the audit cannot see")
    if online.unaudited:
        notes.append(f"steps {online.unaudited.start}..{online.unaudited.stop - 1} have no "
                     f"{'witnessed window' if online.witnessed else 'beacon statement'}: not audited online (the "
                     "bound counts them as bad steps the audit cannot see)")
    for r in online.late:
        notes.append(f"steps {r.start}..{r.stop - 1}: their window was cosigned within a drand period of its "
                     "round, so its draw might have been known: not audited online (the bound counts them as bad "
                     "steps the audit cannot see; the steps its draw selects are replayed all the same)")


def online_summary(online: OnlinePlan) -> dict:
    """The verdict's ``online`` object: the selection and whom it was trusted from."""
    return {"beacon": online.beacon, "p": online.p, "every": online.every, "windows": online.windows,
            "selected": online.selected, "covered": online.covered,
            "unaudited": online.unseen, "final": online.final, "witnessed": online.witnessed, "others": online.others,
            "attempts": online.attempts, "branches": online.branches, "priced": online.priced,
            "trust_warning": online.trust_warning, "uncounted": online.uncounted,
            "linking": online.linking()}


def move_notes(verdict: Verdict, moves: MoveCheck | None, failure: str | None, failed_window: int | None,
               unchunked_online: bool) -> None:
    """The bounded-move check's failure, summary and warnings (blind and spiking steps) in the verdict."""
    if failure is not None:
        verdict.failures.append(failure)
    if moves is not None:
        verdict.moves = moves.to_json() | {"summary": moves.describe()}
        verdict.checks.append(moves.describe())
        if moves.blind:
            verdict.notes.append(f"the schedule lets step(s) {blind_text(moves.blind)} move a coordinate by the whole "
                                 f"RMS of {', '.join(moves.blind_tensors[:3])}"
                                 f"{' and others' if len(moves.blind_tensors) > 3 else ''} or more: a tensor swapped "
                                 "in there passes the bounded-move check, and only replay (at rate p) checks those "
                                 "steps")
        if moves.spikes:
            verdict.notes.append(f"the schedule spikes at step(s) {blind_text(moves.spikes)}: each may move a coordinate "
                                 f"over {SPIKE:g} times as far as the run's median step, so a model that near the honest "
                                 "one passes the bounded-move check there, and only replay (at rate p) checks those "
                                 "steps")
    elif failure is not None:  # which window's openings failed, for a leaderboard to name that file
        verdict.moves = {"failed_window": failed_window, "summary": "every step: the bounded-move check failed"
                         + (f" in the window closing at size {failed_window}" if failed_window else "") + " (below)"}
    elif unchunked_online:
        verdict.notes.append("every step: bounded move not checked (the run commits no parameter chunks)")
