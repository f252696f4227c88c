"""The beacon's HTTP routes (the standalone server and the leaderboard mount the same router)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..commit.signing import public_pem
from ..web import BodyLimit, RateLimit, readable_validation_errors
from .service import RUNS_PAGE, Beacon, BeaconRefused
from .witness import MAX_BODY, Witness, WitnessConflict

SessionFactory = Callable[[], AbstractContextManager[Session]]


class HeadIn(BaseModel):
    """A streamed head: with its manifest the first time, else with its run; and a consistency proof
    from the last head the beacon stamped for the run."""

    model_config = ConfigDict(extra="forbid")
    tree_head: dict
    consistency: list[str] = []
    manifest: str | None = None
    run: str | None = None


class LogIn(BaseModel):
    """A run's log to witness, named by its manifest's log line."""

    model_config = ConfigDict(extra="forbid")
    manifest: str


def router(beacon: Beacon, sessions: SessionFactory, prefix: str = "/api/beacon",
           witness: Witness | None = None) -> APIRouter:
    """The routes: ``GET key``, ``POST heads``, ``GET runs``, ``GET runs/{run}``, and the witness's
    (``witness``, by default one with the beacon's key): ``POST logs``, ``POST add-checkpoint``,
    ``GET {origin hash}/checkpoint``, ``GET witness/logs``, ``GET attempts/{origin hash}``."""
    r = APIRouter(prefix=prefix, tags=["beacon"])
    witness = witness or Witness(beacon.key)

    def db() -> Iterator[Session]:
        with sessions() as s:
            yield s

    @r.get("/key")
    def key() -> dict:
        """The public key the beacon signs its statements with (raw hex and PEM)."""
        return {"public_key": beacon.public_key, "pem": public_pem(beacon.key.public_key()),
                "witness_name": witness.name, "witness_vkey": witness.vkey}

    @r.post("/heads")
    def heads(body: HeadIn, request: Request) -> dict:
        """Stamp a head: its signed statement (beta and the window it opens)."""
        with sessions() as s:
            return beacon.stamp(s, body.tree_head, body.consistency, body.manifest, body.run).to_json()

    @r.get("/runs")
    def runs(limit: Annotated[int, Query(ge=1, le=RUNS_PAGE)] = RUNS_PAGE,
             offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> list[dict]:
        """The runs answered for, newest first, a page at a time (``limit``, ``offset``): aborted runs
        show as runs whose last head is not final."""
        with sessions() as s:
            return beacon.runs(s, limit, offset)

    @r.get("/runs/{run}")
    def run(run: str) -> dict:
        """One run's statements, in order, and any evidence of equivocation."""
        with sessions() as s:
            return beacon.run(s, run)

    @r.post("/logs")
    def logs(body: LogIn) -> dict:
        """Register a run's log with the witness (its origin, and the manifest's key as the log's)."""
        with sessions() as s:
            return witness.register(s, body.manifest)

    @r.post("/add-checkpoint")
    async def add_checkpoint(request: Request) -> Response:
        """tlog-witness's add-checkpoint: the cosignature line, or the spec's status for a refusal."""
        body = bytearray()
        async for chunk in request.stream():  # read within the bound, whatever the client sends
            body += chunk
            if len(body) > MAX_BODY:
                raise BeaconRefused(413, f"an add-checkpoint body is at most {MAX_BODY} bytes")

        def cosign() -> str:
            with sessions() as s:
                return witness.add_checkpoint(s, bytes(body))

        try:
            line = await run_in_threadpool(cosign)
        except WitnessConflict as e:  # the spec's body and type, set exactly (no charset appended)
            return Response(f"{e.latest}\n", 409, headers={"Content-Type": "text/x.tlog.size"})
        return Response(line, 200, media_type="text/plain")

    @r.get("/witness/logs")
    def witness_logs(key: Annotated[str, Query(max_length=64)],
                     limit: Annotated[int, Query(ge=1, le=RUNS_PAGE)] = RUNS_PAGE,
                     offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> list[dict]:
        """The logs the witness has for a log key (hex), newest first, a page at a time: restarts show."""
        with sessions() as s:
            return witness.logs(s, key, limit, offset)

    @r.get("/witness/logs/{origin_hash}")
    def witness_log(origin_hash: str) -> dict:
        """One log the witness has, and the first fork it refused for it (the log's two signed notes)."""
        with sessions() as s:
            return witness.log(s, origin_hash)

    @r.get("/attempts/{origin_hash}")
    def attempts(origin_hash: str) -> Response:
        """A note the witness signs: the log's latest size and the other runs it links and prices in."""
        with sessions() as s:
            return Response(witness.attempts(s, origin_hash), media_type="text/plain")

    @r.get("/{origin_hash}/checkpoint")
    def checkpoint(origin_hash: str) -> Response:
        """tlog-witness's monitoring path: the latest cosigned checkpoint with the log's signature."""
        with sessions() as s:
            return Response(witness.checkpoint(s, origin_hash), media_type="text/plain")

    return r


def install_handlers(app: FastAPI) -> None:
    """JSON errors for refused heads and malformed requests (a 400 with a readable message)."""

    @app.exception_handler(BeaconRefused)
    async def _refused(request: Request, e: BeaconRefused) -> Response:
        body: dict[str, Any] = {"detail": e.message}
        if e.evidence is not None:
            body["evidence"] = e.evidence
        return JSONResponse(body, e.status)


def create_app(db_url: str, key, per_minute: int = 1200, burst: int = 200,  # noqa: ANN001 - an Ed25519 private key
               name: str | None = None, cosigner_key=None,  # noqa: ANN001 - an ML-DSA-44 key or None
               known: tuple = ()) -> FastAPI:
    """A standalone beacon on the database at ``db_url`` (its tables created if missing), a witness
    named ``name`` too (cosigning with ``cosigner_key``, an ML-DSA-44 key, if given; configured for the
    logs of ``known``, their note keys); each client address may make ``per_minute`` requests a minute,
    in bursts of ``burst``."""
    from ..database import make_engine, sessions, shown_url
    from .db import create_tables

    engine = make_engine(db_url)
    try:
        create_tables(engine)
    except OperationalError as e:  # no server there, a wrong password, a file it may not write
        raise ValueError(f"cannot open the database {shown_url(db_url)}: {str(e.orig).strip().splitlines()[0]}") from None
    factory = sessions(engine)
    beacon = Beacon(key)
    app = FastAPI(title="witness beacon", version=__version__,
                  description="Stamps the tree heads a training run streams with fresh, signed randomness.")
    install_handlers(app)

    readable_validation_errors(app)

    witness = Witness(key, name, cosigner_key, known=tuple(known))
    app.include_router(router(beacon, factory, witness=witness))
    # add-checkpoint's own bound (tlog-witness bodies are small) before a byte more is buffered
    app.add_middleware(BodyLimit, paths=((r".*/add-checkpoint", MAX_BODY),))
    app.add_middleware(RateLimit, per_minute=per_minute, burst=burst)  # outermost: a flood is refused first
    app.state.beacon, app.state.witness = beacon, witness
    return app


def served_app() -> FastAPI:
    """The app of one of ``witness beacon serve --workers N``'s processes (uvicorn's factory): its
    database, key file and rate limit come from the environment the command set."""
    import os

    from ..commit.note import NoteKey
    from ..commit.signing import load_key

    cosigner = os.environ.get("WITNESS_BEACON_COSIGNER_KEY")
    return create_app(os.environ["WITNESS_BEACON_DB"], load_key(Path(os.environ["WITNESS_BEACON_KEY"])),
                      per_minute=int(os.environ.get("WITNESS_BEACON_PER_MINUTE", "1200")),
                      name=os.environ.get("WITNESS_BEACON_NAME") or None,
                      cosigner_key=load_key(Path(cosigner), "ml-dsa-44") if cosigner else None,
                      known=tuple(NoteKey.parse(v) for v in os.environ.get("WITNESS_BEACON_LOGS", "").split()))
