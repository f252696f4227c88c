"""Shared pieces of witness's two HTTP servers (``witness serve`` and the leaderboard): a request
body limit, a JSON nesting limit, and uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import threading
import time
from collections import OrderedDict

import numpy as np
from starlette.responses import JSONResponse

from .commit.hashing import MAX_JSON_DEPTH

MAX_JSON_BODY = 1 << 20
BODY_IDLE = 30.0  # seconds a request body may stall between two of its pieces


class BodyLimit:
    """ASGI middleware: request bodies over ``limit`` bytes (or the limit of the first of ``paths``,
    (regular expression, bytes) pairs, that a path matches in full) get a 413, bodies nested deeper than
    ``depth`` a 400, and a body of which nothing arrives for ``idle`` seconds a 408, before anything
    parses them; a client gone mid-body is answered nothing (paths that match a regular expression in
    ``exempt`` in full stream their bodies under limits of their own)."""

    def __init__(self, app, limit: int = MAX_JSON_BODY, exempt: tuple[str, ...] = (),  # noqa: ANN001 - ASGI app
                 depth: int = MAX_JSON_DEPTH, paths: tuple[tuple[str, int], ...] = (), idle: float | None = None):
        self.app, self.limit, self.depth = app, limit, depth
        self.idle = BODY_IDLE if idle is None else idle
        self.exempt = [re.compile(p) for p in exempt]
        self.paths = [(re.compile(p), n) for p, n in paths]

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - ASGI signature
        if scope["type"] != "http" or any(p.fullmatch(scope["path"]) for p in self.exempt):
            return await self.app(scope, receive, send)
        limit = next((n for p, n in self.paths if p.fullmatch(scope["path"])), self.limit)
        # Read the whole (small) body first, so an oversized one gets a 413 before any parsing.
        messages, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle)
            except asyncio.TimeoutError:
                return await JSONResponse({"detail": f"the request body stalled: nothing arrived for {self.idle:g} s"},
                                          408, headers={"Connection": "close"})(scope, receive, send)
            if message["type"] == "http.disconnect":
                return None  # the client left mid-body: no one to answer, nothing to run
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > limit:
                return await JSONResponse({"detail": f"request body over {limit} bytes"}, 413)(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        body = b"".join(m.get("body", b"") for m in messages)
        if json_depth(body) > self.depth:  # a parser would recurse that deep, and so would every walk after it
            return await JSONResponse({"detail": f"request body nested more than {self.depth} levels deep"},
                                      400)(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def client_key(address: str) -> str:
    """Whom a rate limit counts: an IPv4 address, or an IPv6 address's /64 (one host is given a whole
    /64, so counting its single addresses would give it 2^64 buckets)."""
    if ":" not in address:
        return address
    try:
        import ipaddress

        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    except ValueError:
        return address


class RateLimit:
    """ASGI middleware: each client address may make ``per_minute`` requests a minute, in bursts of
    up to ``burst`` (a token bucket); past that it gets a 429 with a ``Retry-After``, before anything
    reads its request. At most ``clients`` addresses are tracked (the longest idle are forgotten), so
    a flood of addresses costs bounded memory."""

    def __init__(self, app, per_minute: int = 1200, burst: int = 200, clients: int = 10_000):  # noqa: ANN001 - ASGI app
        if per_minute < 1 or burst < 1:
            raise ValueError("a rate limit allows at least one request a minute, in bursts of at least one")
        self.app, self.rate, self.burst, self.clients = app, per_minute / 60.0, burst, clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address: (tokens, when)
        self.lock = threading.Lock()

    def allow(self, client: str, now: float | None = None) -> float:
        """0 if ``client`` may make a request now (and count it), else the seconds until it may."""
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens, then = self.buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self.buckets[client] = (tokens - 1 if wait == 0 else tokens, now)
            while len(self.buckets) > self.clients:
                self.buckets.popitem(last=False)
            return wait

    async def __call__(self, scope, receive, send):  # noqa: ANN001 - ASGI signature
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        wait = self.allow(client_key((scope.get("client") or ("unknown", 0))[0]))
        if wait > 0:
            retry = max(1, int(wait + 0.999))
            return await JSONResponse({"detail": f"rate limit: at most {round(self.rate * 60)} requests a minute "
                                                 f"from one address; try again in {retry} s"}, 429,
                                      headers={"Retry-After": str(retry)})(scope, receive, send)
        return await self.app(scope, receive, send)


# A JSON string: its brackets are text, not nesting. An unterminated one runs to the end of the
# body (the body is not JSON, and a parser refuses it anyway): matched so, every quote is passed
# once, where a pattern that must end on a quote tries again from each one (quadratic: a megabyte
# of unterminated strings took half an hour).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.S)
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")


def json_depth(data: bytes) -> int:
    """How deeply a JSON text nests arrays and objects, found without parsing it (at C speed: the
    strings are cut out, then the running count of brackets is taken)."""
    skeleton = np.frombuffer(_STRING.sub(b"", data), np.uint8)
    step = np.isin(skeleton, list(_OPEN)).astype(np.int32) - np.isin(skeleton, list(_CLOSE)).astype(np.int32)
    return int(np.cumsum(step).max(initial=0)) if len(step) else 0


def readable_validation_errors(app) -> None:  # noqa: ANN001 - a FastAPI app
    """A malformed request gets a 400 with a readable message, not a 422 with the framework's internals."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError) -> JSONResponse:  # noqa: ANN001 - a Request
        msgs = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        return JSONResponse({"detail": f"bad request: {msgs}"}, 400)


HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers


def timed_http(header_timeout: float = HEADER_TIMEOUT) -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers are not all in within
    ``header_timeout`` seconds of its opening (or of the previous response): a client that trickles
    its headers (slowloris) holds a connection for that long at most. uvicorn itself times out only
    an idle keep-alive connection."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:  # noqa: ANN001 - an asyncio transport
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _reading_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def handle_events(self) -> None:
            super().handle_events()
            if not self._reading_headers():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._reading_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


def __getattr__(name: str) -> type:
    """``witness.web:TimedHTTP``: the header-timed protocol by name, for uvicorn's worker processes (which
    get a pickled config, so a class made at run time cannot travel); its limit from the environment."""
    if name == "TimedHTTP":
        return timed_http(float(os.environ.get("WITNESS_HEADER_TIMEOUT", HEADER_TIMEOUT)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_uvicorn(app, host: str = "127.0.0.1", port: int = 0,  # noqa: ANN001 - ASGI app
                  header_timeout: float = HEADER_TIMEOUT):
    """uvicorn serving ``app`` in a background thread; returns (server, thread, base URL)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           http=timed_http(header_timeout)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            # an OSError: the commands say it in one line and exit 2 (uvicorn has logged the reason)
            raise OSError(errno.EADDRINUSE, f"the server did not start on {host}:{port} (is the port taken?)")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://{host}:{port}"


def stop_uvicorn(server, thread: threading.Thread) -> None:  # noqa: ANN001 - uvicorn.Server
    """Ask a server started by ``start_uvicorn`` to stop, and wait for it."""
    server.should_exit = True
    thread.join(30)


def serve_until_interrupted(server, thread: threading.Thread) -> int:  # noqa: ANN001 - uvicorn.Server
    """Wait while a server started by ``start_uvicorn`` runs; Ctrl-C stops it. Exit code 0."""
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop_uvicorn(server, thread)
    return 0
