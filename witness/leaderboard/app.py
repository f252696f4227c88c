"""The leaderboard's HTTP face: a JSON API (OpenAPI docs at /docs) and server-rendered pages."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as Path_
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from jinja2 import Environment, FileSystemLoader
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.requests import ClientDisconnect

from .. import __version__
from ..beacon.app import install_handlers as install_beacon_handlers
from ..beacon.app import router as beacon_router
from ..commit.signing import public_pem
from ..errors import MalformedInput
from ..report import FINGERPRINT_CAPTION
from ..store import (
    EVALUATION,
    Upload,
    UploadTooLarge,
    archive_key,
    evaluation_key,
    model_key,
    plot_key,
)
from ..verify.online import MAX_SAMPLES_JSON
from ..web import MAX_JSON_BODY, BodyLimit, readable_validation_errors
from .db import Account, ChallengeRow, Head, Round, Run, Track
from .online import online_progress
from .service import ApiError, Leaderboard, Settings

# a run's id in a path: the tables' ids are 32-bit integers, so anything else is a 400, not a 500
RunId = Annotated[int, Path_(ge=1, le=2**31 - 1)]
LIST_PAGE = 1000  # heads a list returns at most
ROUNDS_PAGE = 100  # challenge rounds a list returns at most (each with its challenges)

log = logging.getLogger("witness.leaderboard")

PAGE_SIZE = 100
MAX_PAGE = 1_000_000  # a larger page number is refused (422), not turned into an overflowing offset
STATUSES = ("ticketed", "pending", "verifying", "certified", "rejected", "revoked")
SORTS = {"metric": Run.metric_value, "submitted": Run.submitted_ms, "steps": Run.steps, "bound": Run.bound,
         "id": Run.id}
CSP = "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'"


class StrictModel(BaseModel):
    """A request body: JSON types as they are ("5" and true are not counts), no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class AccountIn(StrictModel):
    """A registration: a name and an Ed25519 public key (64 hex digits, or PEM SubjectPublicKeyInfo)."""

    name: str = Field(max_length=64)
    public_key: str = Field(max_length=512)


class RunInfo(StrictModel):
    """What the submitter says of a run: a name, a description and a link to its code."""

    title: str | None = Field(default=None, max_length=100)
    description: str | None = Field(default=None, max_length=2000)
    code_url: str | None = Field(default=None, max_length=300)


class TicketIn(RunInfo):
    """A ticket request for a track, with what the submitter says of the run (optional)."""

    track: str = Field(max_length=64)


class HeadIn(StrictModel):
    """A streamed tree head, its consistency proof from the last one, and (first head only) the manifest."""

    tree_head: dict[str, Any]
    consistency: list[str] = Field(default_factory=list, max_length=64)
    manifest: str | None = Field(default=None, max_length=MAX_JSON_BODY)
    # a run with online challenges: the log's records this head newly covers
    records: list[str] = Field(default_factory=list, max_length=10_000)


class ChallengeIn(StrictModel):
    """A request for more replay challenges."""

    count: int


def _session(request: Request):
    with request.app.state.lb.Session() as s:
        yield s


DB = Annotated[Session, Depends(_session)]
_bearer = HTTPBearer(auto_error=False)


def _account(request: Request, s: DB, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Account:
    return request.app.state.lb.authenticate(s, cred.credentials if cred else None)


Acct = Annotated[Account, Depends(_account)]


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


async def paced(chunks: AsyncIterator[bytes], idle: float) -> AsyncIterator[bytes]:
    """The body's pieces, refused (408) where none arrives for ``idle`` seconds: a stalled upload
    holds its file and connection that long at most."""
    it = chunks.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), idle)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise ApiError(408, f"the upload stalled: nothing arrived for {idle:g} s") from None
        yield chunk


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


def create_app(settings: Settings | None = None, lb: Leaderboard | None = None) -> FastAPI:
    """The ASGI application for a leaderboard (built from ``settings`` or an open ``lb``)."""
    lb = lb or Leaderboard(settings)  # type: ignore[arg-type]
    app = FastAPI(title="witness leaderboard", version=__version__,
                  description="Runs certified by this server: it draws the replay challenges itself.")
    app.state.lb = lb
    pages = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True)
    pages.filters["when"] = _fmt_ms
    pages.filters["safe_link"] = safe_link
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": e.message}, e.status)
        return HTMLResponse(pages.get_template("error.html").render(status=e.status, message=e.message), e.status,
                            headers={"Content-Security-Policy": CSP})

    readable_validation_errors(app)

    def html(name: str, **ctx: Any) -> HTMLResponse:
        return HTMLResponse(pages.get_template(name).render(**ctx), headers={"Content-Security-Policy": CSP})

    async def receive(request: Request, limit: int, unpack_limit: int | None = None) -> Upload:
        """Stream a request's body into the store's incoming area (unpacked here in the same pass
        with ``unpack_limit``), refused (413) past ``limit`` bytes."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ApiError(413, f"the upload is over the server's limit of {limit} bytes")
        try:
            return await lb.store.receive(paced(request.stream(), lb.settings.body_idle_timeout), limit, unpack_limit)
        except UploadTooLarge as e:
            raise ApiError(413, str(e)) from None
        except ClientDisconnect:
            # one line, not a traceback: a client going away is no error of the server's
            log.info("%s %s: the client went away during the upload", request.method, request.url.path)
            raise ApiError(400, "the client went away during the upload") from None

    async def drain(request: Request, limit: int) -> None:
        """Read a refused request's body to its end (at most ``limit`` bytes), keeping none of it."""
        seen = 0
        try:
            async for chunk in paced(request.stream(), lb.settings.body_idle_timeout):
                seen += len(chunk)
                if seen > limit:
                    return
        except (ApiError, ClientDisconnect):
            return

    def _limit(acct: Account, run_id: int | None, r: str | None) -> int:
        with lb.Session() as s:
            return lb.upload_limit(s, s.get(Account, acct.id), run_id, r)

    # --- JSON API -----------------------------------------------------------------------
    @app.post("/api/accounts", status_code=201, tags=["accounts"])
    def register(body: AccountIn, s: DB, request: Request) -> dict:
        """Register an Ed25519 public key; the API token is returned once and stored only as a hash.
        A client address may open a limited number of accounts an hour."""
        acct, token = lb.register(s, body.name, body.public_key, request.client.host if request.client else None)
        return {"id": acct.id, "name": acct.name, "public_key": acct.public_key, "token": token}

    @app.get("/api/tracks", tags=["tracks"])
    def tracks(s: DB) -> list[dict]:
        """The registered tracks."""
        return [track_json(t) for t in s.scalars(select(Track).order_by(Track.name))]

    @app.get("/api/tracks/{name}", tags=["tracks"])
    def track(name: str, s: DB) -> dict:
        """One track: its task, exact recipe, dataset root and evaluation split."""
        return track_json(lb.track(s, name))

    @app.get("/api/tracks/{name}/runs", tags=["runs"])
    def track_runs(name: str, s: DB, sort: str = "metric", order: str | None = None, status: str = "all",
                   since: str | None = None, until: str | None = None, page: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1) -> dict:
        """The runs of a track, sorted and filtered like its page."""
        t = lb.track(s, name)
        rows, total = table(s, t, sort, order, status, since, until, page)
        return {"track": name, "total": total, "page": page, "runs": [run_json(r, a, t) for r, a in rows]}

    @app.post("/api/tickets", status_code=201, tags=["runs"])
    def ticket(body: TicketIn, s: DB, acct: Acct) -> dict:
        """Issue a run ticket: the r of the run seed H(data root || r), drawn by the server."""
        run = lb.ticket(s, acct, body.track, body.title, body.description, body.code_url)
        t = lb.track(s, run.track)
        return {"run_id": run.id, "r": run.r, "ticket_ms": run.ticket_ms} | track_json(t)

    @app.post("/api/runs/{run_id}/heads", status_code=201, tags=["runs"])
    def add_head(run_id: RunId, body: HeadIn, s: DB, acct: Acct) -> dict:
        """Stream a signed tree head; the server checks it extends the last one and stamps its time."""
        h = lb.add_head(s, acct, run_id, body.tree_head, body.consistency, body.manifest, body.records)
        statement = lb.stamp(s, h, body.consistency, body.manifest)
        return {"run_id": run_id, "size": h.size, "root": h.root, "received_ms": h.received_ms, "statement": statement}

    @app.put("/api/runs/{run_id}/online/{kind}/{step}", status_code=201, tags=["runs"],
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}}})
    async def online_upload(run_id: RunId, kind: Annotated[str, Path_(pattern="^(states|samples)$")],
                            step: Annotated[int, Path_(ge=0, le=2**31 - 1)], request: Request, acct: Acct) -> dict:
        """Upload, while the run trains, the state before a step the beacon selected (``states``: a
        safetensors file) or its batch's samples (``samples``: JSON); once both are here the server's
        workers replay the step. Each is taken once."""
        def open_slot() -> None:  # who may upload what is decided before a byte of the body is stored
            with lb.Session() as s:
                lb.online_slot(s, s.get(Account, acct.id), run_id, kind, step)

        limit = await run_in_threadpool(_limit, acct, run_id, None) if kind == "states" else MAX_SAMPLES_JSON
        try:
            await run_in_threadpool(open_slot)
        except ApiError:
            await drain(request, limit)  # nothing stored; the client reads its answer, not a reset
            raise
        upload = await receive(request, limit)

        def keep() -> dict:
            try:
                with lb.Session() as s:
                    row = lb.upload_online(s, s.get(Account, acct.id), run_id, kind, step, upload)
                    return {"run_id": run_id, "step": step, "kind": kind, "sha256": upload.sha256, "status": row.status}
            finally:
                lb.store.drop(upload)  # a kept upload has nothing left to drop

        return await run_in_threadpool(keep)

    @app.get("/api/runs/{run_id}/heads", tags=["runs"])
    def heads(run_id: RunId, s: DB, after: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
              limit: Annotated[int, Query(ge=1, le=LIST_PAGE)] = LIST_PAGE) -> list[dict]:
        """The streamed heads with the server's receipt times, in order, a page at a time: at most
        ``limit`` of them, of sizes over ``after`` (the last size of the page before)."""
        lb.run(s, run_id)
        rows = s.scalars(select(Head).where(Head.run_id == run_id, Head.size > after).order_by(Head.size).limit(limit))
        return [head_json(h) for h in rows]

    @app.post("/api/submissions", status_code=202, tags=["runs"],
              openapi_extra={"requestBody": {"required": True, "content": {"application/x-tar": {
                  "schema": {"type": "string", "format": "binary"}}}}})
    async def submit(request: Request, acct: Acct,
                     r: Annotated[str | None, Query(pattern="^[0-9a-fA-F]{64}$")] = None) -> dict:
        """Upload a finished run: a tar of ``bundle/`` and ``evaluation.json``, streamed to disk. ``r``
        (the run's ticket, hex) names the run before its bundle is read, so that its track's upload
        limit applies; without it, the server's."""
        limit = await run_in_threadpool(_limit, acct, None, r)
        try:
            # unpacked as it arrives, within 4x the upload (a compressed archive's bound)
            upload = await receive(request, limit, 4 * limit)
        except MalformedInput as e:
            raise ApiError(400, f"bad upload: {e}") from None

        def check() -> dict:
            with lb.Session() as s:
                a = s.get(Account, acct.id)
                try:
                    run = lb.submit(s, a, upload)
                except MalformedInput as e:
                    raise ApiError(400, f"bad upload: {e}") from None
                return {"run_id": run.id, "status": run.status, "url": f"/runs/{run.id}"}

        return await run_in_threadpool(check)

    @app.get("/api/runs/{run_id}", tags=["runs"])
    def run(run_id: RunId, s: DB) -> dict:
        """A run: status, verdict, bound, evaluation, contamination, streamed heads."""
        r = lb.run(s, run_id)
        out = run_json(r, s.get(Account, r.account_id), s.get(Track, r.track))
        out["verdict"] = json.loads(r.verdict_json) if r.verdict_json else None
        out["heads"] = [head_json(h) for h in lb.heads(s, run_id)]
        out["online"] = online_progress(s, r.id) | {"p": r.online_p} if r.online_p is not None else None
        return out

    @app.patch("/api/runs/{run_id}", tags=["runs"])
    def describe(run_id: RunId, body: RunInfo, s: DB, acct: Acct) -> dict:
        """Set a run's name, description and code link (its owner only; the verdict does not change)."""
        r = lb.describe(s, acct, run_id, body.model_fields_set, body.title, body.description, body.code_url)
        return run_json(r, s.get(Account, r.account_id), s.get(Track, r.track))

    @app.get("/api/server-key", tags=["certification"])
    def server_key() -> dict:
        """The public key this server signs its decisions with (raw hex and PEM)."""
        return {"public_key": lb.public_key, "pem": public_pem(lb.key.public_key())}

    @app.get("/api/runs/{run_id}/certification", tags=["certification"])
    def certification(run_id: RunId, s: DB) -> dict:
        """The server's latest signed decision on a run: an in-toto Statement in a DSSE envelope."""
        r = lb.run(s, run_id)
        if not r.statement:
            raise ApiError(404, f"run {run_id} has no decision yet")
        return json.loads(r.statement)

    @app.post("/api/runs/{run_id}/challenges", status_code=202, tags=["challenges"])
    def challenge(run_id: RunId, body: ChallengeIn, s: DB, acct: Acct) -> dict:
        """Ask for more replay challenges on a certified run (rate-limited); a failure revokes it."""
        job = lb.request_challenges(s, acct, run_id, body.count)
        return {"run_id": run_id, "job_id": job.id, "count": job.count, "status": job.status}

    @app.get("/api/runs/{run_id}/challenges", tags=["challenges"])
    def challenges(run_id: RunId, s: DB, offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                   limit: Annotated[int, Query(ge=1, le=ROUNDS_PAGE)] = ROUNDS_PAGE) -> list[dict]:
        """The run's public challenge history, oldest round first, every challenge with its distances:
        at most ``limit`` rounds, after the first ``offset``."""
        lb.run(s, run_id)
        return history(s, run_id, offset, limit)

    # --- pages --------------------------------------------------------------------------
    def base_url(request: Request) -> str:
        """The server's address as people reach it: links that must work elsewhere (badges) are absolute."""
        return (lb.settings.public_url or str(request.base_url)).rstrip("/")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(s: DB) -> HTMLResponse:
        counts = dict(s.execute(select(Run.track, func.count()).where(Run.status == "certified").group_by(Run.track)).all())
        ts = list(s.scalars(select(Track).order_by(Track.name)))
        return html("index.html", tracks=ts, counts=counts, server_key=lb.public_key)

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
                    ranks=ranks(s, t), recipe=json.loads(t.config_json),
                    rejected=[(r, a) for r, a in others if r.status in ("rejected", "revoked")],
                    waiting=[(r, a) for r, a in others if r.status not in ("rejected", "revoked")],
                    online={r.id: online_progress(s, r.id) for r, _ in others if r.online_p is not None})

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
        return html("run.html", run=r, account=s.get(Account, r.account_id), track=t,
                    heads=lb.heads(s, run_id), rounds=history(s, run_id),
                    verdict=json.loads(r.verdict_json) if r.verdict_json else None,
                    aggregates=json.loads(r.aggregates_json) if r.aggregates_json else None,
                    has_plots="loss.svg" in files, has_bundle="submission.tar" in files,
                    has_model="model.safetensors" in files, bad_fraction=lb.settings.bad_fraction,
                    recipe=json.loads(t.config_json), base=base_url(request), server_key=lb.public_key,
                    fingerprint_caption=FINGERPRINT_CAPTION,
                    online=online_progress(s, r.id) if r.online_p is not None else None)

    @app.get("/runs/{run_id}/badge.svg", include_in_schema=False)
    def badge(run_id: RunId, s: DB) -> Response:
        r = lb.run(s, run_id)
        colour = {"certified": "#2e7d32", "rejected": "#c62828", "revoked": "#c62828"}.get(r.status, "#757575")
        label = r.status if r.status != "certified" else f"certified {100 * (r.bound or 0):.0f}%"
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

    # the online-challenge beacon, the same code as `witness beacon serve`, signing with the server key
    app.include_router(beacon_router(lb.beacon, lb.Session))
    install_beacon_handlers(app)
    app.add_middleware(BodyLimit, limit=MAX_JSON_BODY,
                       exempt=("/api/submissions", r"/api/runs/[0-9]+/online/(states|samples)/[0-9]+"))
    return app


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
            "higher_is_better": t.higher_is_better, "description": t.description, "online_p": t.online_p}


def run_json(r: Run, a: Account, t: Track) -> dict:
    """JSON form of a run (without its verdict)."""
    return {"id": r.id, "track": r.track, "account": a.name, "status": r.status, "metric": t.metric,
            "metric_value": r.metric_value, "aggregates": json.loads(r.aggregates_json) if r.aggregates_json else None,
            "bound": r.bound, "challenges_passed": r.challenges_passed,
            "eval_bound": r.eval_bound, "contamination": r.contamination, "data_root": t.data_root,
            "steps": r.steps, "final_root": r.final_root, "final_size": r.final_size,
            "final_state_hash": r.final_state_hash, "r": r.r, "ticket_ms": r.ticket_ms,
            "submitted_ms": r.submitted_ms, "decided_ms": r.decided_ms, "reason": r.reason,
            "bundle_sha256": r.bundle_sha256, "bundle_bytes": r.bundle_bytes, "title": r.title,
            "description": r.description, "code_url": r.code_url,
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
