"""The trainer's side of a beacon: stream heads, receive statements, fetch them again after a crash."""

from __future__ import annotations

import time

import httpx

from ..commit.beacon import BeaconStatement, run_id
from ..commit.hashing import same
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead, public_key_from_hex
from ..errors import VerificationError


class BeaconError(Exception):
    """The beacon refused a head or could not be reached."""


class BeaconClient:
    """A beacon at ``url`` (or behind an ``httpx.Client`` a test or a leaderboard session made).

    ``expected_key`` pins the beacon's public key (hex); otherwise the client takes the key the
    beacon serves. Every statement is checked against that key and the head it answers.
    """

    def __init__(self, url_or_client: str | httpx.Client, expected_key: str | None = None, *, prefix: str = "/api/beacon",
                 retries: int = 5, timeout: float = 60.0, patience: float = 600.0):
        self.http = httpx.Client(base_url=url_or_client.rstrip("/"), timeout=timeout) \
            if isinstance(url_or_client, str) else url_or_client
        # ``retries`` bounds a request made before training (a wrong address fails fast);
        # ``patience`` is how long a head or an upload made while training is tried again when the
        # beacon cannot be reached or is overloaded: training goes on meanwhile, until the ring is full.
        self.prefix, self.retries, self.patience = prefix, retries, patience
        self.heads_path = f"{prefix}/heads"  # where heads go (the leaderboard takes them per run)
        served = self._get("/key")["public_key"]
        if expected_key is not None and served != expected_key:
            raise BeaconError(f"the beacon serves key {served[:16]}…, not the pinned {expected_key[:16]}…")
        self.public_key = served
        self._public = public_key_from_hex(served)
        self.last_size = 0  # the size of the last head the beacon stamped for this client's run
        self.sent_size = 0  # the size of the last head a request was made for

    def _request(self, method: str, path: str, *, patient: bool = False, **kw) -> httpx.Response:  # noqa: ANN003
        """The response to a request, tried again on a transport error (and, ``patient``, on a 5xx
        or 429 answer too) with a doubling pause: ``retries`` times, or for ``patience`` seconds."""
        deadline = time.monotonic() + self.patience
        attempt = 0
        while True:
            try:
                # a body given as a function is made again for each attempt (a stream is read once)
                args = {k: (v() if k == "content" and callable(v) else v) for k, v in kw.items()}
                resp = getattr(self.http, method.lower())(path, **args)
                if not (patient and (resp.status_code >= 500 or resp.status_code == 429)):
                    return resp
            except httpx.TransportError as e:
                resp, error = None, e
            attempt += 1
            out_of_time = time.monotonic() >= deadline if patient else attempt >= self.retries
            if out_of_time:
                if resp is None:
                    raise httpx.ConnectError(f"{error} (after {attempt} attempt(s))") from error
                return resp
            time.sleep(min(2 ** (attempt - 1), 8))

    def _get(self, path: str) -> dict:
        resp = self._request("GET", self.prefix + path)
        if resp.status_code != 200:
            raise BeaconError(f"beacon: {resp.status_code} {_detail(resp)}")
        return resp.json()

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
            raise BeaconError(f"the beacon refused the head of size {head.size}: {resp.status_code} {_detail(resp)}")
        st = self.check(self.statement_of(resp.json()), log)
        if st.size != head.size or not same(st.root, head.root):
            raise BeaconError("the beacon's statement answers another head")
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
        except VerificationError as e:
            raise BeaconError(f"the beacon's statement does not verify: {e}") from None
        if not same(st.run, run_id(log.lines[0])):
            raise BeaconError("the beacon's statement names another run")
        return st

    def statements(self, log: RunLog) -> list[BeaconStatement]:
        """Every statement the beacon holds for the run (none if it never answered for it)."""
        resp = self._request("GET", f"{self.prefix}/runs/{run_id(log.lines[0]).hex()}")
        if resp.status_code == 404:
            return []
        if resp.status_code != 200:
            raise BeaconError(f"beacon: {resp.status_code} {_detail(resp)}")
        out = [self.check(s, log) for s in resp.json()["statements"]]
        self.last_size = max([self.last_size, *(s.size for s in out)])
        self.sent_size = max(self.sent_size, self.last_size)
        return out


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail"))[:500]
    except ValueError:
        return resp.text[:200]
