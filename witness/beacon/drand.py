"""drand over HTTP: a client that fetches and checks a chain's rounds, and a local drand-compatible
endpoint of one signer for tests and the demo.

The client speaks drand's standard HTTP API (``GET {url}/{chain hash}/public/{round}`` and
``/{chain hash}/info``, as drand's http-relay serves them); every round it returns has had its BLS
signature checked against the pinned chain (``witness.commit.drand``), never against what the
endpoint says about itself.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ..commit.drand import (
    MAX_ROUND,
    SCHEME_G1_RFC9380,
    ChainInfo,
    current_round,
    public_key_g2,
    round_time,
    secret_key,
    sign_round_g1,
    verify_round,
)
from ..commit.hashing import from_hex, load_json, same, sha256
from ..errors import VerificationError
from .client import BeaconError

MAX_DRAND_ANSWER = 64 << 10  # bytes: a round's answer is about 250, a chain's info about 500
LOCAL_BEACON_ID = "witness-local"  # a local chain's beacon id: never a League of Entropy one
_ROUND_FIELDS = {"round", "randomness", "signature", "previous_signature"}
_MAX_SIGNATURE_HEX = 2 * 96  # a G2 signature, the larger of the two


class DrandError(BeaconError):
    """A drand endpoint could not be reached, or gave no round that verifies; the message names it."""


class DrandClient:
    """The rounds of the pinned ``chain`` from the drand HTTP endpoint at ``url``, each verified.

    ``timeout`` bounds each request (connecting, and reading the whole answer); ``patience`` is how
    long after a round is due the client keeps asking for it (drand answers 425 Too Early, or 404 on
    older relays, until the round exists); ``max_wait`` is the longest it sleeps for a round to come due.
    """

    def __init__(self, url: str, chain: ChainInfo, *, timeout: float = 10.0, patience: float = 60.0,
                 max_wait: float = 600.0, http: httpx.Client | None = None):
        if not isinstance(url, str) or not re.match(r"https?://[^/\s]", url.strip()):
            raise DrandError(f"the drand endpoint's URL {str(url)[:80]!r} is not an http:// or https:// URL")
        self.url, self.chain = url.strip().rstrip("/"), chain
        self.timeout, self.patience, self.max_wait = timeout, patience, max_wait
        self.where = f"the drand endpoint at {self.url}"
        self._owned = http is None
        self.http = httpx.Client(timeout=timeout) if http is None else http

    def close(self) -> None:
        """Close the connections this client opened."""
        if self._owned:
            self.http.close()

    def __enter__(self) -> DrandClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self) -> ChainInfo:
        """The chain info the endpoint serves for the pinned chain hash; ``DrandError`` unless it is the pinned chain."""
        try:
            status, body = self._get(f"/{self.chain.hash.hex()}/info")
        except httpx.TransportError as e:
            raise DrandError(f"cannot reach {self.where}: {type(e).__name__}: {str(e)[:200]}") from None
        if status != 200:
            raise DrandError(f"{self.where} answered its chain info with HTTP {status}: {_shown(body)}")
        try:
            served = ChainInfo.from_json(load_json(body))
        except (ValueError, VerificationError) as e:
            raise DrandError(f"{self.where} serves a chain info that does not parse or check: {e}") from None
        if served != self.chain:
            raise DrandError(f"{self.where} serves {served.name()}, not the pinned {self.chain.name()}")
        return served

    def fetch(self, round: int) -> tuple[bytes, bytes]:
        """Round ``round``'s (signature, randomness), waiting until it is due; verified against the pinned chain."""
        if type(round) is not int or not 1 <= round < MAX_ROUND:
            raise ValueError(f"a drand round is an integer from 1 to 2^62, not {str(round)[:40]}")
        wait = round_time(self.chain, round) - time.time()
        if wait > self.max_wait:
            raise DrandError(f"round {round} of {self.chain.name()} is due in {wait:.0f} s, later than this client "
                             f"waits ({self.max_wait:.0f} s)")
        if wait > 0:
            time.sleep(wait)
        give_up = time.monotonic() + self.patience
        pause, last = 0.25, "no answer"
        path = f"/{self.chain.hash.hex()}/public/{round}"
        while True:
            try:
                status, body = self._get(path)
            except httpx.TransportError as e:  # unreachable, or too slow: tried again within the patience
                last = f"{type(e).__name__}: {str(e)[:200]}"
            else:
                if status == 200:
                    return self._checked(round, body)
                # 425 (http-relay) or 404 (drand's own handler): not yet; 429 and 5xx: overloaded, for now
                if status not in (404, 425, 429) and status < 500:
                    raise DrandError(f"{self.where} refused round {round} of {self.chain.name()}: HTTP {status} "
                                     f"{_shown(body)}")
                last = f"HTTP {status} {_shown(body)}"
            left = give_up - time.monotonic()
            if left <= 0:
                raise DrandError(f"{self.where} gave no round {round} of {self.chain.name()} within "
                                 f"{self.patience:.0f} s of its time (last answer: {last})")
            time.sleep(min(pause, left))
            pause = min(2 * pause, 2.0, float(self.chain.period))

    def _checked(self, round: int, body: bytes) -> tuple[bytes, bytes]:
        """The (signature, randomness) of a 200 answer for ``round``, or ``DrandError`` saying what is wrong."""
        what = f"{self.where} answered round {round} of {self.chain.name()}"
        try:
            obj = load_json(body)
        except ValueError as e:
            raise DrandError(f"{what} with something that is not JSON ({e}): {_shown(body)}") from None
        if not isinstance(obj, dict) or not {"round", "signature"} <= set(obj) <= _ROUND_FIELDS:
            raise DrandError(f"{what} with no drand round (fields round, signature, and randomness, "
                             f"previous_signature at most): {_shown(body)}")
        if type(obj["round"]) is not int or obj["round"] != round:
            raise DrandError(f"{what} with round {str(obj['round'])[:40]}")
        try:
            signature = _hex(obj["signature"], "signature")
            sent = _hex(obj["randomness"], "randomness", 32) if "randomness" in obj else None
            if "previous_signature" in obj:  # chained rounds only (refused below): still hex, or no round
                _hex(obj["previous_signature"], "previous_signature")
        except ValueError as e:
            raise DrandError(f"{what}: {e}") from None
        try:
            randomness = verify_round(self.chain, round, signature)
        except VerificationError as e:
            raise DrandError(f"{what}, and it does not verify: {e}") from e
        if sent is not None and not same(sent, randomness):
            raise DrandError(f"{what} with randomness {sent.hex()[:16]}…, not SHA-256 of its signature")
        return signature, randomness

    def _get(self, path: str) -> tuple[int, bytes]:
        """One GET, its whole answer (headers too) read within ``timeout`` seconds and ``MAX_DRAND_ANSWER``
        bytes. httpx bounds each read, not the answer: an endpoint that trickles its headers a byte at a time
        would hold it for ever, so the GET runs in a thread of its own, left behind at the deadline."""
        ends = time.monotonic() + self.timeout
        done: list = []

        def attempt() -> None:
            try:
                done.append(self._read(path, ends))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller below
                done.append(e)

        worker = threading.Thread(target=attempt, daemon=True, name="drand-get")
        worker.start()
        worker.join(self.timeout + 1.0)
        if not done:  # still reading: one attempt spent, never the patience
            raise httpx.ReadTimeout(f"no whole answer to {path[:80]} in {self.timeout:.0f} s")
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]

    def _read(self, path: str, ends: float) -> tuple[int, bytes]:
        """The GET of ``_get``, its body's reads held to ``ends``."""
        # the size bound is on the bytes sent: a compressed answer could inflate far past it
        with self.http.stream("GET", self.url + path, headers={"Accept-Encoding": "identity"}) as resp:
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise DrandError(f"{self.where} answered in {encoding[:40]!r}, not the identity encoding asked for")
            body = bytearray()
            for chunk in resp.iter_raw():
                body += chunk
                if len(body) > MAX_DRAND_ANSWER:
                    raise DrandError(f"{self.where} answered {path[:80]} with over {MAX_DRAND_ANSWER} bytes; refused")
                if time.monotonic() > ends:  # a trickled answer costs one attempt, never the patience
                    raise httpx.ReadTimeout(f"no whole answer to {path[:80]} in {self.timeout:.0f} s")
            return resp.status_code, bytes(body)


def _hex(value: object, what: str, size: int | None = None) -> bytes:
    """Hex of ``size`` bytes (any size up to a G2 signature's when None), or ``ValueError``."""
    if not isinstance(value, str) or len(value) > _MAX_SIGNATURE_HEX or len(value) % 2:
        raise ValueError(f"{what} is not hex of at most {_MAX_SIGNATURE_HEX // 2} bytes")
    return from_hex(value, what, len(value) // 2 if size is None else size)


def _shown(body: bytes) -> str:
    """The start of an answer as plain text (a hostile endpoint's control characters escaped)."""
    text = body[:200].decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class LocalDrand:
    """A drand-compatible chain of one signer (bls-unchained-g1-rfc9380, as quicknet), for tests and
    the demo: its own key pair (from ``seed``, reproducible, or fresh), beacon id ``witness-local``."""

    def __init__(self, *, seed: bytes | None = None, period: int = 3, genesis_time: int | None = None):
        self._secret = secret_key(seed)
        public = public_key_g2(self._secret)
        genesis = int(time.time()) if genesis_time is None else genesis_time
        # drand's group hash is a digest of its nodes' group file; one signer has none, so bind the key and start
        group = sha256(b"witness/drand-local-group/v1\x00" + public + genesis.to_bytes(8, "big", signed=True))
        self.chain = ChainInfo.build(public, period, genesis, group, SCHEME_G1_RFC9380, LOCAL_BEACON_ID)

    def __repr__(self) -> str:
        return f"LocalDrand({self.chain.name()}, period {self.chain.period} s)"

    def sign(self, round: int) -> bytes:
        """This chain's signature of ``round`` (48 bytes)."""
        round_time(self.chain, round)  # a round out of range is refused as a verifier would
        return sign_round_g1(self._secret, round)

    def latest(self, now: float | None = None) -> int:
        """The latest round due at ``now`` (default: the clock); 0 before genesis."""
        return current_round(self.chain, time.time() if now is None else now)

    def beacon(self, round: int) -> dict:
        """Round ``round`` as drand's HTTP API serves it."""
        signature = self.sign(round)
        return {"round": round, "randomness": sha256(signature).hex(), "signature": signature.hex()}


_ROUND_TEXT = re.compile(r"[0-9]{1,19}")


def create_app(local: LocalDrand) -> FastAPI:
    """drand's HTTP API for ``local``: ``GET /chains``, ``/health``, ``/info``, ``/{hash}/info``,
    ``/{hash}/health``, ``/{hash}/public/latest`` and ``/{hash}/public/{round}`` (a round not yet due gets
    425, as drand's http-relay answers)."""
    app = FastAPI(title="witness local drand", docs_url=None, redoc_url=None, openapi_url=None)
    ours = local.chain.hash.hex()

    def unknown(chain: str) -> JSONResponse | None:
        # http-relay's answer to a chain it does not serve: a refusal, not "not yet"
        return None if chain == ours else JSONResponse({"detail": "unknown chain hash"}, 400)

    def answer(round: int) -> JSONResponse:
        latest = local.latest()
        if round == 0:  # drand's "latest"
            round = latest
        if round == 0 or round > latest:
            return JSONResponse({"detail": "Requested future beacon"}, 425,
                                headers={"Cache-Control": "must-revalidate, no-cache, max-age=0"})
        return JSONResponse(local.beacon(round), headers={"Cache-Control": "public, max-age=604800, immutable"})

    @app.get("/chains")
    def chains() -> list[str]:
        """The chains it serves, by hash (drand's discovery route): this one."""
        return [ours]

    def healthy() -> JSONResponse:
        # drand's answer: the latest round it has and the one due now, 200 when it is at most one behind
        latest = local.latest()
        return JSONResponse({"current": latest, "expected": latest},
                            headers={"Cache-Control": "public, must-revalidate, max-age=1"})

    @app.get("/health")
    def health() -> JSONResponse:
        """Whether it is serving rounds as they come due (it signs each when asked: always)."""
        return healthy()

    @app.get("/{chain}/health")
    def chain_health(chain: str) -> JSONResponse:
        """The chain's health, under its hash."""
        return unknown(chain) or healthy()

    @app.get("/info")
    def info() -> dict:
        """The chain's info (drand's v1 JSON)."""
        return local.chain.to_json()

    @app.get("/{chain}/info")
    def chain_info(chain: str) -> object:
        """The chain's info, under its hash."""
        return unknown(chain) or local.chain.to_json()

    @app.get("/{chain}/public/latest")
    def latest(chain: str) -> JSONResponse:
        """The latest round."""
        return unknown(chain) or answer(0)

    @app.get("/{chain}/public/{round}")
    def public(chain: str, round: str) -> JSONResponse:
        """One round, once it is due."""
        if not _ROUND_TEXT.fullmatch(round) or int(round) >= MAX_ROUND:
            return JSONResponse({"detail": "Failed to parse round"}, 400)
        return unknown(chain) or answer(int(round))

    return app
