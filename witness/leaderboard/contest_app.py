"""The routes of contest tracks: submit a method (a wheel), list a track's methods, read and download one."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi import Path as Path_
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from sqlalchemy import select
from starlette.requests import ClientDisconnect

from ..methods.wheel import MAX_WHEEL_BYTES
from .common import ApiError
from .contests import method_json, method_key
from .db import Account, Method
from .deps import DB, Acct

MethodId = Annotated[int, Path_(ge=1, le=2**31 - 1)]
METHODS_ROUTE = r"/api/tracks/[^/]+/methods"


def add_method_routes(app: FastAPI, lb, paced) -> None:  # noqa: ANN001 - the Leaderboard, the app's body pacer
    """Mount the method routes on ``app``."""

    @app.post(METHODS_ROUTE.replace("[^/]+", "{name}"), tags=["methods"],
              responses={200: {"description": "the account's method with these files, admitted before"},
                         201: {"description": "admitted"}})
    async def submit_method(name: str, request: Request, acct: Acct,
                            title: Annotated[str | None, Query(alias="name", max_length=100)] = None,
                            task: Annotated[str | None, Query(max_length=64)] = None) -> Response:
        """Submit a method to a contest track: the wheel's bytes as the body (at most 4 MiB). The server reads
        it strictly, describes it in the sandbox and refuses it if its recipe exceeds the track's budget."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_WHEEL_BYTES):
            raise ApiError(413, f"a method's wheel is at most {MAX_WHEEL_BYTES} bytes")
        data = bytearray()
        try:
            async for chunk in paced(request.stream(), lb.settings.body_idle_timeout):
                data += chunk
                if len(data) > MAX_WHEEL_BYTES:
                    raise ApiError(413, f"a method's wheel is at most {MAX_WHEEL_BYTES} bytes")
        except ClientDisconnect:
            raise ApiError(400, "the client went away during the upload") from None

        def admit() -> tuple[dict, bool]:
            with lb.Session() as s:
                m, new = lb.register_method(s, s.get(Account, acct.id), name, bytes(data), title, task)
                return method_json(m, acct.name), new

        body, new = await run_in_threadpool(admit)
        return JSONResponse(body, 201 if new else 200)

    @app.get("/api/tracks/{name}/methods", tags=["methods"])
    def track_methods(name: str, s: DB) -> list[dict]:
        """A contest track's methods, oldest first."""
        t = lb.track(s, name)
        rows = s.execute(select(Method, Account.name).join(Account, Method.account_id == Account.id)
                         .where(Method.track == t.name).order_by(Method.id)).all()
        return [method_json(m, a) for m, a in rows]

    @app.get("/api/methods/{method_id}", tags=["methods"])
    def method(method_id: MethodId, s: DB) -> dict:
        """One method: its pin, its recipe as the sandbox described it, and where its wheel is."""
        m = lb.method(s, method_id)
        return method_json(m, s.get(Account, m.account_id).name)

    @app.get("/methods/{method_id}/wheel", include_in_schema=False)
    def method_wheel(method_id: MethodId, s: DB) -> Response:
        m = lb.method(s, method_id)
        return lb.store.response(method_key(m.wheel_sha256), filename=f"{m.distribution}-{m.version}-py3-none-any.whl",
                                 redirect=True)
