"""An operator log's HTTP routes (``witness operator serve``): runs register and send their heads; anyone
reads its checkpoint, its entries and consistency proofs between its sizes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..commit.operator import MAX_HEAD_NOTE_BYTES, MAX_MANIFEST_BYTES
from ..web import BodyLimit, RateLimit, readable_validation_errors
from .app import install_handlers
from .operator import ENTRIES_PAGE, MAX_PROOF, OperatorLog
from .service import BeaconRefused

PREFIX = "/api/operator"
_HEX64 = r"^[0-9a-f]{64}$"


class RunIn(BaseModel):
    """A run to register: its manifest line."""

    model_config = ConfigDict(extra="forbid")
    manifest: str = Field(max_length=MAX_MANIFEST_BYTES)


class HeadIn(BaseModel):
    """One of a run's heads: its checkpoint (signed by the run's key) and a consistency proof from its
    latest head in the log (size ``old``; 0 for its first)."""

    model_config = ConfigDict(extra="forbid")
    run: str = Field(pattern=_HEX64)
    checkpoint: str = Field(max_length=MAX_HEAD_NOTE_BYTES)
    old: int = Field(ge=0, le=(1 << 63) - 1)
    proof: list[Annotated[str, Field(pattern=_HEX64)]] = Field(default=[], max_length=MAX_PROOF)


def router(log: OperatorLog, prefix: str = PREFIX,
           admit: Callable[[Request, str, RunIn | HeadIn], None] | None = None) -> APIRouter:
    """``GET key``, ``POST runs``, ``POST heads`` (answered once a cosigned checkpoint holds the head),
    ``GET checkpoint``, ``GET entries``, ``GET consistency``. ``admit(request, kind, body)`` (kind "run" or
    "head") raises where the writer may not write (a leaderboard takes only its accounts' own runs, and
    only the heads they streamed to it)."""
    r = APIRouter(prefix=prefix, tags=["operator"])

    @r.get("/key")
    def key() -> dict:
        """The log's origin, its note key, its witnesses' quorum."""
        return {"origin": log.origin, "vkey": log.vkey.vkey(), "witnesses": [w.key.vkey() for w in log.witnesses],
                "required": log.required}

    @r.post("/runs")
    async def runs(body: RunIn, request: Request) -> dict:
        """Register a run (its manifest becomes an entry, before any of its heads)."""
        def register() -> dict:
            if admit is not None:
                admit(request, "run", body)
            return log.register(body.manifest.encode("utf-8"))

        return await run_in_threadpool(register)

    @r.post("/heads")
    async def heads(body: HeadIn, request: Request) -> dict:
        """Append a head; the first cosigned checkpoint that holds it, and its inclusion proof there."""
        def append() -> dict:
            if admit is not None:
                admit(request, "head", body)
            index = log.add_head(body.run, body.checkpoint.encode("utf-8"), body.old,
                                 [bytes.fromhex(h) for h in body.proof])
            return log.cosigned(index)

        return await run_in_threadpool(append)

    @r.get("/checkpoint")
    def checkpoint() -> Response:
        """The latest cosigned checkpoint (the log's signature and the witnesses'), 404 if none yet."""
        cp = log.latest()
        if cp is None:
            raise BeaconRefused(404, "no checkpoint has been cosigned yet")
        return Response(cp.note, 200, media_type="text/plain")

    @r.get("/entries")
    def entries(start: Annotated[int, Query(ge=0, le=(1 << 63) - 1)] = 0,
                count: Annotated[int, Query(ge=1, le=ENTRIES_PAGE)] = ENTRIES_PAGE) -> dict:
        """Entries from ``start``, at most ``count`` (their bytes as text, in order)."""
        return {"start": start, "entries": log.entries(start, count)}

    @r.get("/consistency")
    def consistency(old: Annotated[int, Query(ge=1)], new: Annotated[int, Query(ge=1)]) -> dict:
        """A consistency proof from size ``old`` to size ``new``."""
        return {"old": old, "new": new, "proof": log.consistency(old, new)}

    return r


def create_app(log: OperatorLog, per_minute: int = 1200) -> FastAPI:
    """The operator log's app."""
    app = FastAPI(title="witness operator log", version=__version__,
                  description="One long-lived log of many runs' heads, cosigned by tlog-witnesses.")
    install_handlers(app)
    readable_validation_errors(app)
    app.include_router(router(log))
    app.add_middleware(BodyLimit)
    app.add_middleware(RateLimit, per_minute=per_minute, burst=200)
    app.state.operator = log
    return app
