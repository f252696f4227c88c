"""The trainer's side of a beacon: stream heads, receive statements, fetch them again after a crash."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ..commit.beacon import BeaconStatement, run_id
from ..commit.hashing import load_json, same
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead, public_key_from_hex
from ..errors import VerificationError

MAX_ANSWER = 1 << 20  # bytes: a statement or a key is well under a KiB
MAX_RUN_ANSWER = 64 << 20  # bytes: a run's statements, after a crash (about 100,000 of them)


class BeaconError(Exception):
    """The beacon refused a head or could not be reached."""


class BoundedClient:
    """A service at ``url`` (or behind an ``httpx.Client`` a test or a leaderboard session made),
    asked within bounds: every attempt has a total deadline and every answer a size bound, and a
    request is tried again on a transport error (and, ``patient``, on a 5xx or a 429)."""

    error: type[Exception] = BeaconError  # what a refused answer raises

    def __init__(self, url_or_client: str | httpx.Client, *, what: str, empty_url: str, retries: int = 5,
                 timeout: float = 60.0, patience: float = 600.0, deadline: float = 120.0):
        self._owned = isinstance(url_or_client, str)
        if self._owned and not url_or_client.strip():
            raise self.error(empty_url)
        self.http = httpx.Client(base_url=url_or_client.rstrip("/"), timeout=timeout) \
            if self._owned else url_or_client
        self.where = f"{what} at {self.http.base_url}".rstrip("/") if self._owned else what
        self.timeout, self.deadline = timeout, deadline
        # ``retries`` bounds a request made before training (a wrong address fails fast);
        # ``patience`` is how long a head or an upload made while training is tried again when the
        # service cannot be reached or is overloaded: training goes on meanwhile, until the ring is full.
        self.retries, self.patience = retries, patience
        self.request_cpu_seconds = 0.0  # CPU time of the threads that made the requests (what it costs the caller)

    def _request(self, method: str, path: str, *, patient: bool = False, deadline: float | None = None,
                 limit: int = MAX_ANSWER, **kw) -> Answer:  # noqa: ANN003
        """The answer to a request, tried again on a transport error (and, ``patient``, on a 5xx
        or 429 answer too) with a doubling pause: for ``patience`` seconds at most, and (not
        ``patient``: a request made before training, so a wrong address fails fast) ``retries`` times.
        Each attempt has ``deadline`` seconds in all (default: the client's), not only per read, and
        an answer over ``limit`` bytes is refused."""
        give_up = time.monotonic() + self.patience
        attempt = 0
        while True:
            try:
                # a body given as a function is made again for each attempt (a stream is read once)
                args = {k: (v() if k == "content" and callable(v) else v) for k, v in kw.items()}
                allowed = self.deadline if deadline is None else deadline
                allowed = max(min(allowed, give_up - time.monotonic()), 1.0)  # never past the patience
                resp = self._once(method, path, allowed, limit, args)
                if not (patient and (resp.status_code >= 500 or resp.status_code == 429)):
                    return resp
            except httpx.TransportError as e:
                resp, error = None, e
            attempt += 1
            out_of_time = time.monotonic() >= give_up or (not patient and attempt >= self.retries)
            if out_of_time:
                if resp is None:
                    raise httpx.ConnectError(f"{error} (after {attempt} attempt(s))") from error
                return resp
            time.sleep(min(2 ** (attempt - 1), 8, max(give_up - time.monotonic(), 0.0)))

    def _once(self, method: str, path: str, allowed: float, limit: int, args: dict) -> Answer:
        """One attempt, in a thread of its own so that it ends within ``allowed`` seconds however the
        beacon trickles its answer (httpx times out each read, not a whole answer)."""
        out: dict = {}
        http = self.http
        ends = time.monotonic() + allowed

        def attempt() -> None:
            cpu = time.thread_time()
            try:
                headers = {**(args.pop("headers", None) or {}), "Accept-Encoding": "identity"}
                with http.stream(method, path, headers=headers, **args) as resp:
                    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):  # decoded, a few bytes may inflate to gigabytes
                        out["error"] = self.error(f"{self.where} answered in {encoding[:40]!r}, not the identity "
                                                  "encoding asked for; refused")
                        return
                    body = bytearray()
                    for chunk in resp.iter_raw():
                        body += chunk
                        if len(body) > limit:
                            out["error"] = self.error(f"{self.where} answered with over {limit} bytes; refused")
                            return
                        if time.monotonic() > ends:
                            return
                    out["answer"] = Answer(resp.status_code, bytes(body), self.where)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                out["error"] = e
            finally:
                self.request_cpu_seconds += time.thread_time() - cpu

        worker = threading.Thread(target=attempt, name="witness-beacon-request", daemon=True)
        worker.start()
        worker.join(allowed)
        if "answer" in out:
            return out["answer"]
        if "error" in out:
            raise out["error"]
        # still reading (or it stopped at the deadline): that connection is given up, the next
        # attempt opens another one
        if self._owned:
            self.http = httpx.Client(base_url=str(http.base_url), timeout=self.timeout)
            threading.Thread(target=http.close, daemon=True).start()
        raise httpx.ReadTimeout(f"{self.where} sent no whole answer in {allowed:.0f} s")


class BeaconClient(BoundedClient):
    """A beacon at ``url`` (or behind an ``httpx.Client`` a test or a leaderboard session made).

    ``expected_key`` pins the beacon's public key (hex); otherwise the client takes the key the
    beacon serves. Every statement is checked against that key and the head it answers.
    """

    def __init__(self, url_or_client: str | httpx.Client, expected_key: str | None = None, *, prefix: str = "/api/beacon",
                 retries: int = 5, timeout: float = 60.0, patience: float = 600.0, deadline: float = 120.0):
        super().__init__(url_or_client, what="the beacon", empty_url="the beacon's URL is empty (--beacon URL)",
                         retries=retries, timeout=timeout, patience=patience, deadline=deadline)
        self.prefix = prefix
        self.heads_path = f"{prefix}/heads"  # where heads go (the leaderboard takes them per run)
        served = self._get("/key").get("public_key")
        try:
            self._public = public_key_from_hex(served)
        except (VerificationError, ValueError, TypeError):
            raise BeaconError(f"{self.where} serves no Ed25519 public key (its /key answer has "
                              f"{str(served)[:40]!r})") from None
        if expected_key is not None and served != expected_key:
            raise BeaconError(f"{self.where} serves key {served[:16]}…, not the pinned {expected_key[:16]}…")
        self.public_key = served
        self.last_size = 0  # the size of the last head the beacon stamped for this client's run
        self.sent_size = 0  # the size of the last head a request was made for

    def _get(self, path: str) -> dict:
        resp = self._request("GET", self.prefix + path)
        if resp.status_code != 200:
            raise BeaconError(f"{self.where}: {resp.status_code} {_detail(resp)}")
        answer = resp.json()
        if not isinstance(answer, dict):
            raise BeaconError(f"{self.where} answered {path} with a JSON {type(answer).__name__}, not an object")
        return answer

    def stamp(self, head: SignedTreeHead, log: RunLog) -> BeaconStatement:
        """Send ``head`` with its proof of extending the last stamped head; the checked statement."""
        return self.post(self.body(head, log), head, log)

    def body(self, head: SignedTreeHead, log: RunLog) -> dict:
        """The request for ``head``: its proof that it extends the head sent before it (built while
        the log is not being appended to; the request itself may go out later, in order)."""
        body: dict = {"tree_head": head.to_json()}
        if self.sent_size == 0:
            body["manifest"] = log.lines[0].decode()
            body["consistency"] = [h.hex() for h in log.tree.consistency_proof(1, head.size)] if head.size > 1 else []
        else:
            body["run"] = run_id(log.lines[0]).hex()
            body["consistency"] = [h.hex() for h in log.tree.consistency_proof(self.sent_size, head.size)] \
                if head.size > self.sent_size else []
        self.sent_size = max(self.sent_size, head.size)
        return body

    def post(self, body: dict, head: SignedTreeHead, log: RunLog) -> BeaconStatement:
        """Send a request ``body`` made for ``head``; the checked statement."""
        resp = self._request("POST", self.heads_path, json=body, patient=True)
        if not 200 <= resp.status_code < 300:
            self.sent_size = self.last_size  # the next request proves from what the beacon did stamp
            raise BeaconError(f"{self.where} refused the head of size {head.size}: {resp.status_code} {_detail(resp)}")
        st = self.check(self.statement_of(resp.json()), log)
        if st.size != head.size or not same(st.root, head.root):
            raise BeaconError(f"{self.where}'s statement answers another head")
        self.last_size = max(self.last_size, st.size)
        return st

    @staticmethod
    def statement_of(answer: object) -> object:
        """The statement in the answer to a head (the beacon's answer is the statement itself)."""
        return answer

    def check(self, obj: object, log: RunLog) -> BeaconStatement:
        """A statement for this run, signed by this beacon (else ``BeaconError``)."""
        try:
            st = BeaconStatement.from_json(obj)
            st.verify(self._public)
        except (VerificationError, ValueError, TypeError, KeyError) as e:
            raise BeaconError(f"{self.where}'s statement does not verify: {e}") from None
        if not same(st.run, run_id(log.lines[0])):
            raise BeaconError(f"{self.where}'s statement names another run")
        return st

    def statements(self, log: RunLog) -> list[BeaconStatement]:
        """Every statement the beacon holds for the run (none if it never answered for it)."""
        resp = self._request("GET", f"{self.prefix}/runs/{run_id(log.lines[0]).hex()}", limit=MAX_RUN_ANSWER)
        if resp.status_code == 404:
            return []
        if resp.status_code != 200:
            raise BeaconError(f"{self.where}: {resp.status_code} {_detail(resp)}")
        answer = resp.json()
        if not isinstance(answer, dict) or not isinstance(answer.get("statements"), list):
            raise BeaconError(f"{self.where} answered for the run without a list of statements")
        out = [self.check(s, log) for s in answer["statements"]]
        self.last_size = max([self.last_size, *(s.size for s in out)])
        self.sent_size = max(self.sent_size, self.last_size)
        return out


@dataclass(frozen=True)
class Answer:
    """A beacon's whole answer, read within its bounds."""

    status_code: int
    content: bytes
    where: str = "the beacon"

    @property
    def text(self) -> str:
        """The body as text (what cannot be decoded shown as such)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:  # noqa: ANN401 - any JSON value
        """The body as JSON, its nesting bounded; else ``BeaconError`` naming the beacon and what it sent."""
        try:
            return load_json(self.content)
        except ValueError as e:
            raise BeaconError(f"{self.where} answered with something that is not JSON ({e}): "
                              f"{self.content[:60]!r}") from None


def _detail(resp: Answer | httpx.Response) -> str:
    """What a refusal says, as plain text (a hostile server's control characters shown escaped, never
    sent to the terminal)."""
    try:
        answer = resp.json()
        text = str(answer.get("detail") if isinstance(answer, dict) else answer)[:500]
    except (ValueError, BeaconError):
        text = resp.text[:200]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
