"""The leaderboard's HTTP face: a JSON API (OpenAPI docs at /docs) and server-rendered pages."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as Path_
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader
from sqlalchemy import select
from starlette.requests import ClientDisconnect

from .. import __version__
from ..beacon.app import install_handlers as install_beacon_handlers
from ..beacon.app import router as beacon_router
from ..beacon.operator_app import router as operator_router
from ..commit.signing import public_pem
from ..errors import MalformedInput
from ..store import (
    Upload,
    UploadTooLarge,
)
from ..verify.kept import MAX_SAMPLES_JSON
from ..web import MAX_JSON_BODY, BodyLimit, readable_validation_errors
from . import board
from .contest_app import METHODS_ROUTE, add_method_routes
from .contests import method_json
from .db import Account, Head, Track
from .deps import DB, Acct, RunId
from .online import online_progress
from .pages import add_pages
from .schemas import AccountIn, ChallengeIn, HeadIn, RunInfo, TicketIn, WindowIn
from .service import ApiError, Leaderboard, Settings
from .views import (
    CSP,
    MAX_PAGE,
    _fmt_ms,
    head_json,
    history,
    run_json,
    safe_link,
    table,
    track_json,
)

LIST_PAGE = 1000  # heads a list returns at most
ROUNDS_PAGE = 100  # challenge rounds a list returns at most (each with its challenges)

log = logging.getLogger("witness.leaderboard")


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
        run = lb.ticket(s, acct, body.track, body.title, body.description, body.code_url, body.method)
        t = lb.track(s, run.track)
        method = method_json(lb.method(s, run.method_id), acct.name) if run.method_id else None
        return {"run_id": run.id, "r": run.r, "ticket_ms": run.ticket_ms, "method": method} | track_json(t)

    @app.post("/api/runs/{run_id}/heads", status_code=201, tags=["runs"])
    def add_head(run_id: RunId, body: HeadIn, s: DB, acct: Acct) -> dict:
        """Stream a signed tree head; the server checks it extends the last one and stamps its time."""
        h = lb.add_head(s, acct, run_id, body.tree_head, body.consistency, body.manifest, body.records)
        statement = lb.stamp(s, h, body.consistency, body.manifest)
        return {"run_id": run_id, "size": h.size, "root": h.root, "received_ms": h.received_ms, "statement": statement}

    @app.post("/api/runs/{run_id}/windows", status_code=201, tags=["runs"])
    def add_window(run_id: RunId, body: WindowIn, s: DB, acct: Acct) -> dict:
        """A witnessed run's window, once its drand round came: checked (its head entered in this server's
        operator log, cosigned by the track's witnesses, the round signed by the drand chain), and the steps
        its draw selects then take their uploads."""
        row = lb.add_window(s, acct, run_id, body.window)
        return {"run_id": run_id, "size": row.size, "round": row.round, "cosigners": json.loads(row.cosigners_json),
                "on_time": row.on_time}

    @app.put("/api/runs/{run_id}/online/{kind}/{step}", status_code=201, tags=["runs"],
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}}})
    async def online_upload(run_id: RunId, kind: Annotated[str, Path_(pattern="^(states|samples|chunks)$")],
                            step: Annotated[int, Path_(ge=0, le=2**31 - 1)], request: Request, acct: Acct) -> dict:
        """Upload, while the run trains, the state before a step the beacon selected (``states``: a
        safetensors file) or its batch's samples (``samples``: JSON); once both are here the server's
        workers replay the step. A run that commits its parameters' chunks uploads each window's chunk
        openings too (``chunks``, by the head size the window closes at: a safetensors file), which the
        workers check for every step of the window. Each is taken once."""
        def open_slot() -> int:  # who may upload what is decided before a byte of the body is stored
            with lb.Session() as s:
                window = lb.online_slot(s, s.get(Account, acct.id), run_id, kind, step)
                return lb.openings_limit(s, run_id, window) if kind == "chunks" else 0

        # a state and a window's openings within the track's upload limit (openings also within what their
        # window's states, chunks and paths can take); samples within the samples' bound
        limit = await run_in_threadpool(_limit, acct, run_id, None) if kind != "samples" else MAX_SAMPLES_JSON
        try:
            limit = min(limit, await run_in_threadpool(open_slot) or limit)
        except ApiError:
            await drain(request, limit)  # nothing stored; the client reads its answer, not a reset
            raise
        upload = await receive(request, limit)

        def keep() -> dict:
            try:
                with lb.Session() as s:
                    if kind == "chunks":
                        row = lb.upload_openings(s, s.get(Account, acct.id), run_id, step, upload)
                    else:
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
        out["online"] = online_progress(s, r) | {"p": r.online_p} if r.online_p is not None else None
        if out["online"] is not None and lb.witnessed(s.get(Track, r.track)) is not None:
            out["online"]["windows_witnessed"] = lb.windows_page(s, r)  # its drand rounds, and who cosigned each
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

    @app.get("/api/board/checkpoint", tags=["certification"])
    def board_checkpoint(s: DB) -> Response:
        """The latest checkpoint of the board's own history (every decision an entry), signed by the server
        as a C2SP signed note; keep it, and check the next against it (``witness leaderboard check-board``)."""
        return Response(board.checkpoint(s, lb.key, lb.public_key), media_type="text/plain")

    @app.get("/api/board/entries", tags=["certification"])
    def board_entries(s: DB, start: Annotated[int, Query(ge=0, le=2**62)] = 0,
                      count: Annotated[int, Query(ge=1, le=board.PAGE)] = board.PAGE) -> dict:
        """The board's entries from ``start`` (canonical JSON, in order)."""
        return {"start": start, "entries": board.entries(s, start, count)}

    @app.get("/api/board/consistency", tags=["certification"])
    def board_consistency(s: DB, old: Annotated[int, Query(ge=1, le=2**62)],
                          new: Annotated[int, Query(ge=1, le=2**62)]) -> dict:
        """A consistency proof between two sizes of the board's history."""
        try:
            return {"old": old, "new": new, "proof": board.consistency(s, old, new)}
        except ValueError as e:
            raise ApiError(400, str(e)) from None

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

    add_pages(app, lb, html, pages)
    add_method_routes(app, lb, paced)

    # the online-challenge beacon, the same code as `witness beacon serve`, signing with the server key
    app.include_router(beacon_router(lb.beacon, lb.Session))
    if lb.settings.witnessing is not None:  # the operator log of its witnessed tracks' runs (this process appends)
        app.include_router(operator_router(lb.operator_log(), admit=lambda request, kind, body: lb.admit_operator(
            request.headers.get("authorization"), body.manifest if kind == "run" else None,
            (body.run, body.checkpoint) if kind == "head" else None)))
    install_beacon_handlers(app)
    app.add_middleware(BodyLimit, limit=MAX_JSON_BODY,
                       exempt=("/api/submissions", r"/api/runs/[0-9]+/online/(states|samples|chunks)/[0-9]+",
                               METHODS_ROUTE))
    return app


