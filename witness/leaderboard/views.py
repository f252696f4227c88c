"""What the leaderboard shows of its tracks and runs: the tables, ranks, record history and JSON
views its API and pages share."""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from ..store import EVALUATION, archive_key, evaluation_key, model_key, plot_key
from .db import Account, ChallengeRow, Head, Method, Round, Run, Track
from .ranking import MethodEntry, Seed, rank_methods
from .service import ApiError, Leaderboard

PAGE_SIZE = 100


MAX_PAGE = 1_000_000  # a larger page number is refused (422), not turned into an overflowing offset


STATUSES = ("ticketed", "pending", "verifying", "certified", "rejected", "revoked")


SORTS = {"metric": Run.metric_value, "submitted": Run.submitted_ms, "steps": Run.steps, "bound": Run.bound,
         "id": Run.id}


def default_order(track: Track, sort: str) -> str:
    """Best first for the metric, newest first for dates, largest first otherwise."""
    if sort == "metric":
        return "desc" if track.higher_is_better else "asc"
    return "desc"


def table(s: Session, track: Track, sort: str, order: str | None, status: str, since: str | None,
          until: str | None, page: int) -> tuple[list[tuple[Run, Account]], int]:
    """One page of a track's table, sorted and filtered."""
    if sort not in SORTS:
        raise ApiError(400, f"sort by one of {', '.join(SORTS)}")
    order = order or default_order(track, sort)
    if order not in ("asc", "desc"):
        raise ApiError(400, "order is asc or desc")
    if status != "all" and status not in STATUSES:
        raise ApiError(400, f"status is all or one of {', '.join(STATUSES)}")
    q = select(Run, Account).join(Account, Run.account_id == Account.id).where(Run.track == track.name)
    if status != "all":
        q = q.where(Run.status == status)
    lo, hi = _date_ms(since), _date_ms(until, end=True)
    when = func.coalesce(Run.submitted_ms, Run.ticket_ms)
    if lo is not None:
        q = q.where(when >= lo)
    if hi is not None:
        q = q.where(when < hi)
    total = s.scalar(select(func.count()).select_from(q.subquery()))
    col = SORTS[sort]
    q = q.order_by(col.is_(None), col.desc() if order == "desc" else col.asc(), Run.id)
    rows = s.execute(q.offset((page - 1) * PAGE_SIZE).limit(PAGE_SIZE)).all()
    return [(r, a) for r, a in rows], total


# a seed tried and not shown: a run never submitted, or submitted and then rejected or revoked
_tried_not_shown = or_(Run.submitted_ms.is_(None), Run.status.in_(("rejected", "revoked")))


def methods(s: Session, track: Track) -> list[MethodEntry]:
    """The track's methods (on a track of one recipe, each account's runs), ranked by their certified seeds
    (``ranking``), with the runs each account started and never submitted."""
    entries: dict[str, MethodEntry] = {}
    contest = track.contest_json is not None
    # on a contest track a method is its admitted wheel (named with its number and account); else an account
    names = {m.id: f"{m.name} (#{m.id}, {a})" for m, a in s.execute(
        select(Method, Account.name).join(Account, Method.account_id == Account.id).where(Method.track == track.name))} \
        if contest else {}
    key = Run.method_id if contest else Account.name
    rows = s.execute(select(key, Run.id, Run.metric_value, Run.decided_ms).select_from(Run)
                     .join(Account, Run.account_id == Account.id).where(
                         Run.track == track.name, Run.status == "certified", Run.metric_value.is_not(None))
                     .order_by(Run.id)).all()
    for k, run_id, value, decided in rows:
        name = names.get(k, str(k)) if contest else k
        entries.setdefault(name, MethodEntry(name, [])).seeds.append(Seed(run_id, value, decided or 0))
    for k, count in s.execute(select(key, func.count()).select_from(Run).join(Account, Run.account_id == Account.id)
                              .where(Run.track == track.name, _tried_not_shown).group_by(key)).all():
        name = names.get(k, str(k)) if contest else k
        if name in entries:
            entries[name].unsubmitted = count
    if contest:  # a method copied until its seeds were lucky: the account's other methods and runs show it
        owner = {names[m]: a for m, a in s.execute(select(Method.id, Method.account_id).where(Method.track == track.name))}
        admitted = dict(s.execute(select(Method.account_id, func.count()).where(Method.track == track.name)
                                  .group_by(Method.account_id)).all())
        unsent = dict(s.execute(select(Run.account_id, func.count()).where(
            Run.track == track.name, _tried_not_shown).group_by(Run.account_id)).all())
        for e in entries.values():
            a = owner.get(e.method)
            e.account_unsubmitted, e.account_methods = unsent.get(a, 0), admitted.get(a, 0)
    return rank_methods(list(entries.values()), track.higher_is_better, track.min_seeds)


def ranks(s: Session, track: Track) -> dict[int, int]:
    """Each certified run's rank by the track's metric, best first; equal scores share a rank."""
    col = Run.metric_value.desc() if track.higher_is_better else Run.metric_value.asc()
    rows = s.execute(select(Run.id, Run.metric_value).where(
        Run.track == track.name, Run.status == "certified", Run.metric_value.is_not(None)).order_by(col, Run.id)).all()
    out: dict[int, int] = {}
    for i, (run_id, value) in enumerate(rows):
        out[run_id] = out[rows[i - 1][0]] if i and value == rows[i - 1][1] else i + 1
    return out


def history_svg(track: Track, points: list[tuple[int, int, float]]) -> str:
    """The record history: the best certified score over time, each new record marked with its run."""
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    better = (lambda a, b: a > b) if track.higher_is_better else (lambda a, b: a < b)
    xs, best, records = [], [], []
    for run_id, ms, value in points:
        when = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
        if not best or better(value, best[-1]):
            records.append((when, value, run_id))
        xs.append(when)
        best.append(value if not best or better(value, best[-1]) else best[-1])
    if xs:
        ax.step(xs + [dt.datetime.now(dt.timezone.utc)], best + best[-1:], where="post", color="tab:blue",
                label="best certified score")
        ax.scatter([w for w, _, _ in records], [v for _, v, _ in records], color="tab:blue", zorder=3)
        for when, value, run_id in records:
            ax.annotate(f"#{run_id}", (when, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.scatter(xs, [v for _, _, v in points], s=8, color="grey", zorder=2, label="certified run")
        ax.legend(fontsize=8)
        fig.autofmt_xdate()
    else:
        ax.text(0.5, 0.5, "no certified run yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"{track.name}: record history ({'higher' if track.higher_is_better else 'lower'} is better)")
    ax.set_xlabel("decided (UTC)")
    ax.set_ylabel(track.metric)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def safe_link(url: str | None) -> str | None:
    """A submitter's code link, only if it is plain http(s) (never javascript: or data:)."""
    return url if url and url.startswith(("https://", "http://")) and len(url) <= 300 else None


def track_json(t: Track) -> dict:
    """JSON form of a track."""
    return {"track": t.name, "task": t.task, "config": json.loads(t.config_json), "data_root": t.data_root,
            "eval_root": t.eval_root, "eval_size": t.eval_size, "metric": t.metric,
            "higher_is_better": t.higher_is_better, "description": t.description, "online_p": t.online_p,
            # a witnessed track: the witnesses and quorum, the operator log and the drand chain its runs pin
            "witnessed": json.loads(t.witnessed_json) if t.witnessed_json else None,
            # a contest track: the budget its runs' methods keep (its task fixes only data, split and scoring)
            "contest": json.loads(t.contest_json) if t.contest_json else None}


def run_json(r: Run, a: Account, t: Track) -> dict:
    """JSON form of a run (without its verdict). Its ticket's r is not shown while it trains: with the
    data root it gives the run seed, under which anyone could register runs that price this one down."""
    return {"id": r.id, "track": r.track, "account": a.name, "status": r.status, "metric": t.metric,
            "metric_value": r.metric_value, "aggregates": json.loads(r.aggregates_json) if r.aggregates_json else None,
            "bound": r.bound, "challenges_passed": r.challenges_passed,
            "eval_bound": r.eval_bound, "contamination": r.contamination, "data_root": t.data_root,
            "steps": r.steps, "final_root": r.final_root, "final_size": r.final_size,
            "final_state_hash": r.final_state_hash, "r": r.r if r.status != "ticketed" else None, "ticket_ms": r.ticket_ms,
            "submitted_ms": r.submitted_ms, "decided_ms": r.decided_ms, "reason": r.reason,
            "bundle_sha256": r.bundle_sha256, "bundle_bytes": r.bundle_bytes, "title": r.title,
            "description": r.description, "code_url": r.code_url, "method": r.method_id,
            "certification": f"/api/runs/{r.id}/certification" if r.statement else None}


def head_json(h: Head) -> dict:
    """JSON form of a streamed head, with the server's stamp."""
    return {"size": h.size, "root": h.root, "received_ms": h.received_ms, "tree_head": json.loads(h.head_json)}


def history(s: Session, run_id: int, offset: int = 0, limit: int | None = None) -> list[dict]:
    """The challenge rounds on a run, oldest first (``limit`` of them after the first ``offset``; all
    by default), with each challenge's distances."""
    out = []
    for rnd in s.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.id).offset(offset).limit(limit)):
        who = s.get(Account, rnd.requested_by).name if rnd.requested_by else "server"
        rows = s.scalars(select(ChallengeRow).where(ChallengeRow.round_id == rnd.id).order_by(ChallengeRow.step))
        out.append({"round": rnd.id, "job_id": rnd.job_id, "kind": rnd.kind, "requested_by": who, "nonce": rnd.nonce, "count": rnd.count,
                    "passed": rnd.passed, "bound": rnd.bound, "detail": rnd.detail, "worker": rnd.worker,
                    "finished_ms": rnd.finished_ms,
                    "challenges": [{"step": c.step, "length": c.length, "passed": c.passed,
                                    "distances": json.loads(c.distances_json), "failure": c.failure} for c in rows]})
    return out


def _date_ms(value: str | None, end: bool = False) -> int | None:
    if not value:
        return None
    try:
        d = dt.datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        raise ApiError(400, f"dates are YYYY-MM-DD, not {value!r}") from None
    if end and d.date() == dt.date.max:  # the day after the last date there is: no bound at all
        return None
    return int((d + (dt.timedelta(days=1) if end else dt.timedelta())).timestamp() * 1000)


def _fmt_ms(ms: int | None) -> str:
    return "" if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


CSP = "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'"


DOWNLOADS = ("submission.tar", EVALUATION, "model.safetensors")


def committed_files(lb: Leaderboard, r: Run) -> dict[str, str]:
    """The stored objects of a run that a committed row names, by name (their keys): the submission
    once its row records it (its SHA-256), the released model once a certification is committed,
    the plots once any decision is. Objects are stored before the row that makes them visible, so a
    crash between the two leaves objects nobody is shown (and the next start removes them)."""
    out: dict[str, str] = {}
    if r.bundle_sha256 is not None:
        out["submission.tar"] = archive_key(r.id)
        out[EVALUATION] = evaluation_key(r.id)
    if r.status in ("certified", "revoked") and r.statement:
        out["model.safetensors"] = model_key(r.id)
    if r.decided_ms is not None:
        for name in ("loss", "optimizer", "fingerprints"):
            out[f"{name}.svg"] = plot_key(r.id, name)
    return {k: key for k, key in out.items() if lb.store.exists(key)}


# --- figures, rounded for reading ------------------------------------------------------------
# A page must never claim more than was checked: a bound (a probability of detection) is rounded
# down, the bad fraction it holds against rounded up (a bound that holds against >= 5 % of bad steps
# holds against >= 6 %, not against >= 4 %), and a selection probability rounded down.


def _decimal(x: float) -> Decimal:
    """The shortest decimal that reads back as ``x`` (so 0.99 is 0.99, not 0.98999…)."""
    return Decimal(repr(float(x)))


def _plain(d: Decimal) -> str:
    """A decimal without trailing zeros or exponent."""
    text = f"{d:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def percent_down(x: float, places: int = 1) -> str:
    """A probability as a percentage rounded down to ``places`` decimals ("99.0"; "100" only for 1)."""
    if x >= 1:
        return "100"
    return f"{(_decimal(x) * 100).quantize(Decimal(1).scaleb(-places), rounding=ROUND_FLOOR):f}"


def percent_up(x: float, places: int = 2) -> str:
    """A fraction as a percentage rounded up to at most ``places`` decimals, no trailing zeros ("5")."""
    return _plain((_decimal(x) * 100).quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING))


def fraction_down(x: float, places: int = 4) -> str:
    """A probability such as p rounded down to at most ``places`` decimals ("0.7845")."""
    return _plain(_decimal(x).quantize(Decimal(1).scaleb(-places), rounding=ROUND_FLOOR))


def bound_text(bound: float, bad_fraction: float, bad: str = "bad steps") -> str:
    """What a detection bound says: "≥ 99.0 % against ≥ 5 % bad steps" (both rounded the safe way)."""
    shown = "100 %" if bound >= 1 else f"≥ {percent_down(bound)} %"  # a bound of 1: no bad run escapes
    return f"{shown} against ≥ {percent_up(bad_fraction)} % {bad}"


def number(x: object) -> str:
    """A figure for reading: integers whole, other numbers to 4 significant digits."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def step_ranges(steps: list[int]) -> str:
    """Steps as ranges: "0–4, 7, 9–12"."""
    runs: list[list[int]] = []
    for t in sorted(set(steps)):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "none"


# VerificationError's form "step N: replay: …": a replay reached step N and it did not match
_REPLAY_FAILED = re.compile(r"^step (\d+): replay: ")


def audit_replayed(verdict: dict) -> dict:
    """The distinct steps one audit replayed itself, each counted once: those its ledger holds
    (replayed from a checked committed state onto a compared one; not those an earlier audit
    replayed) and those where its replay failed. A verifier that replays a failed segment again for
    each later challenge in it runs those steps again, and its ``replayed_steps`` counts every
    pass; the share of the training is taken over distinct steps, so it never passes 100 %."""
    ledger = verdict.get("ledger") or []
    earlier = {e["step"] for e in ledger if e.get("earlier")}
    steps = {e["step"] for e in ledger if not e.get("earlier")}
    for r in verdict.get("results") or []:
        m = _REPLAY_FAILED.match(r.get("failure") or "")
        if m:
            steps.add(int(m.group(1)))
    total = verdict.get("steps") or 0
    steps = {t for t in steps if 0 <= t < total}
    return {"steps": sorted(steps), "count": len(steps), "total": total, "earlier": len(earlier - steps),
            "share": percent_down(len(steps) / total, 2) if total else "0"}


def challenge_counts(rounds: list[dict]) -> list[dict]:
    """The run's challenges split by when they were drawn and who asked: at submission (the
    server), while it trained (the server's beacon; its rounds together, each step once), and each
    later round (by its asker)."""
    out: list[dict] = []
    live = [r for r in rounds if r["kind"] == "online"]
    if live:
        steps = {c["step"]: c["passed"] for r in live for c in r["challenges"]}
        out.append({"when": "while it trained", "who": "this server's beacon (selected), its workers (replayed)",
                    "rounds": len(live), "challenges": len(steps), "matched": sum(steps.values()),
                    "failed": len(steps) - sum(steps.values()), "passed": all(r["passed"] for r in live),
                    "finished_ms": max(r["finished_ms"] for r in live), "kind": "online"})
    for r in rounds:
        if r["kind"] == "online":
            continue
        matched = sum(1 for c in r["challenges"] if c["passed"])
        out.append({"when": "at submission" if r["kind"] == "certify" else f"later (round {r['round']})",
                    "who": "this server" if r["requested_by"] == "server" else r["requested_by"],
                    "rounds": 1, "challenges": len(r["challenges"]), "matched": matched,
                    "failed": len(r["challenges"]) - matched, "passed": r["passed"], "finished_ms": r["finished_ms"],
                    "kind": r["kind"]})
    return out
