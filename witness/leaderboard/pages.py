"""The leaderboard's pages: server-rendered HTML, badges, plots and downloads."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment
from sqlalchemy import func, select

from ..evals.evaluate import verify_eval
from ..report import FINGERPRINT_CAPTION
from . import board
from .contests import budget_of
from .db import Account, Method, Run, Track
from .deps import DB, RunId
from .online import online_progress
from .ranking import ALPHA, TEST
from .service import ApiError, Leaderboard
from .views import (
    CSP,
    DOWNLOADS,
    MAX_PAGE,
    PAGE_SIZE,
    audit_replayed,
    bound_text,
    challenge_counts,
    committed_files,
    default_order,
    fraction_down,
    history,
    history_svg,
    methods,
    number,
    percent_down,
    percent_up,
    ranks,
    step_ranges,
    table,
)


def reaudit_command(run: Run, account: Account, track: Track, server_key: str, bad_fraction: float,
                    confidence: float) -> str:
    """The one command that re-audits a run's downloaded bundle as this server did: unpack
    ``run-ID-submission.tar`` and ``witness verify`` its bundle, pinned to the run's ticket, the
    trainer's key and the track's data root; a run that took online challenges from this server is
    audited online, under this server's key as its beacon (its bundle leaves out checkpoints)."""
    folder = f"run-{run.id}"
    mode = f"--mode online --beacon-key {server_key}" if run.online_p is not None else "--mode offline"
    # every value is hex or a number the server chose: nothing here needs shell quoting
    return (f"mkdir -p {folder} && tar -xf {folder}-submission.tar -C {folder} && witness verify {folder}/bundle "
            f"{mode} --signer {account.public_key} --ticket {run.r} --data-root {track.data_root} "
            f"--bad-fraction {bad_fraction!r} --confidence {confidence!r}")


# the fraction of forged results the evaluation's spot-check bound holds against: verify_eval's
# default, which the worker uses
EVAL_FORGED: float = inspect.signature(verify_eval).parameters["forged_fraction"].default


def add_pages(app: FastAPI, lb: Leaderboard, html: Callable[..., HTMLResponse], pages: Environment) -> None:
    """Add the pages' routes to ``app`` (``html`` renders a template of ``pages`` with the pages' headers)."""
    for name, f in (("number", number), ("percent_down", percent_down), ("percent_up", percent_up),
                    ("fraction_down", fraction_down), ("step_ranges", step_ranges)):
        pages.filters[name] = f

    # --- pages --------------------------------------------------------------------------
    def base_url(request: Request) -> str:
        """The server's address as people reach it: links that must work elsewhere (badges) are absolute."""
        return (lb.settings.public_url or str(request.base_url)).rstrip("/")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(s: DB) -> HTMLResponse:
        counts = dict(s.execute(select(Run.track, func.count()).where(Run.status == "certified").group_by(Run.track)).all())
        ts = list(s.scalars(select(Track).order_by(Track.name)))
        return html("index.html", tracks=ts, counts=counts, server_key=lb.public_key, board=board.tree(s))

    @app.get("/tracks/{name}", response_class=HTMLResponse, include_in_schema=False)
    def track_page(name: str, s: DB, sort: str = "metric", order: str | None = None,
                   since: str | None = None, until: str | None = None, page: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1) -> HTMLResponse:
        t = lb.track(s, name)
        rows, total = table(s, t, sort, order, "certified", since, until, page)  # the ranking: certified runs only
        order = order or default_order(t, sort)
        others = s.execute(select(Run, Account).join(Account, Run.account_id == Account.id)
                           .where(Run.track == t.name, Run.status != "certified")
                           .order_by(Run.id.desc()).limit(PAGE_SIZE)).all()
        return html("track.html", track=t, rows=rows, total=total, sort=sort, order=order,
                    since=since or "", until=until or "", page=page, pages=max(1, -(-total // PAGE_SIZE)),
                    ranks=ranks(s, t), recipe=json.loads(t.config_json), methods=methods(s, t), test=TEST, alpha=ALPHA,
                    rejected=[(r, a) for r, a in others if r.status in ("rejected", "revoked")],
                    waiting=[(r, a) for r, a in others if r.status not in ("rejected", "revoked")],
                    online={r.id: online_progress(s, r) for r, _ in others if r.online_p is not None},
                    bad_fraction=lb.settings.bad_fraction, bound_text=bound_text, contest=budget_of(t),
                    submitted=s.execute(select(Method, Account.name).join(Account, Method.account_id == Account.id)
                                        .where(Method.track == t.name).order_by(Method.id)).all())

    @app.get("/tracks/{name}/history.svg", include_in_schema=False)
    def record_history(name: str, s: DB) -> Response:
        t = lb.track(s, name)
        points = s.execute(select(Run.id, Run.decided_ms, Run.metric_value).where(
            Run.track == t.name, Run.status == "certified", Run.metric_value.is_not(None),
            Run.decided_ms.is_not(None)).order_by(Run.decided_ms, Run.id)).all()
        body = history_svg(t, [(i, ms, v) for i, ms, v in points])
        return Response(body, media_type="image/svg+xml",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP})

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    def run_page(run_id: RunId, s: DB, request: Request) -> HTMLResponse:
        r = lb.run(s, run_id)
        files = committed_files(lb, r)
        t = s.get(Track, r.track)
        acct = s.get(Account, r.account_id)
        rounds = history(s, run_id)
        verdict = json.loads(r.verdict_json) if r.verdict_json else None
        f = lb.settings.bad_fraction  # the fraction the certification's bound is computed (and signed) against
        return html("run.html", run=r, account=acct, track=t,
                    heads=lb.heads(s, run_id), rounds=rounds, counts=challenge_counts(rounds),
                    verdict=verdict, replayed=audit_replayed(verdict) if verdict else None,
                    aggregates=json.loads(r.aggregates_json) if r.aggregates_json else None,
                    has_plots="loss.svg" in files, has_bundle="submission.tar" in files,
                    has_model="model.safetensors" in files, bad_fraction=f,
                    bound=bound_text(r.bound, f) if r.status == "certified" and r.bound is not None else None,
                    eval_bound=bound_text(r.eval_bound, EVAL_FORGED, "forged results")
                    if r.eval_bound is not None else None,
                    reaudit=reaudit_command(r, acct, t, lb.public_key, f, lb.settings.confidence)
                    if "submission.tar" in files else None,
                    recipe=json.loads(t.config_json), base=base_url(request), server_key=lb.public_key,
                    fingerprint_caption=FINGERPRINT_CAPTION,
                    online=online_progress(s, r) if r.online_p is not None else None,
                    witnessed=lb.windows_page(s, r) if lb.witnessed(t) is not None else None)

    @app.get("/runs/{run_id}/badge.svg", include_in_schema=False)
    def badge(run_id: RunId, s: DB) -> Response:
        r = lb.run(s, run_id)
        colour = {"certified": "#2e7d32", "rejected": "#c62828", "revoked": "#c62828"}.get(r.status, "#757575")
        # the badge says what the bound is of: P(detect) against a fraction of bad steps, rounded the safe way
        label = r.status if r.status != "certified" or r.bound is None else \
            f"certified: {bound_text(r.bound, lb.settings.bad_fraction)}"
        body = pages.get_template("badge.svg").render(label=label, colour=colour, width=70 + 7 * len(label))
        return Response(body, media_type="image/svg+xml",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP})

    @app.get("/runs/{run_id}/plots/{name}.svg", include_in_schema=False)
    def plot(run_id: RunId, name: str, s: DB) -> Response:
        r = lb.run(s, run_id)
        if name not in ("loss", "optimizer", "fingerprints"):
            raise ApiError(404, "no such plot")
        key = committed_files(lb, r).get(f"{name}.svg")
        if key is None:
            raise ApiError(404, "the run has no plots yet")
        response = lb.store.response(key, media_type="image/svg+xml")
        response.headers["Content-Security-Policy"] = CSP
        return response

    @app.get("/runs/{run_id}/download/{name}", include_in_schema=False)
    def download(run_id: RunId, name: str, s: DB) -> Response:
        r = lb.run(s, run_id)
        stored = {"verdict.json": r.verdict_json, "certification.dsse.json": r.statement}
        if name in stored:
            if not stored[name]:
                raise ApiError(404, f"the run has no {name.split('.')[0]} yet")
            return Response(stored[name], media_type="application/json",
                            headers={"Content-Disposition": f'attachment; filename="run-{run_id}-{name}"'})
        files = committed_files(lb, r)
        if name not in DOWNLOADS or name not in files:
            raise ApiError(404, f"run {run_id} has no {name}")
        return lb.store.response(files[name], filename=f"run-{run_id}-{name}", redirect=True)
