"""The trainer's side of a leaderboard: register, get a ticket, stream heads, submit, challenge."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..beacon.client import BeaconClient, BeaconError, BoundedClient, _detail
from ..beacon.operator_link import OperatorLink
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead
from ..store import pack

TOKENS = Path.home() / ".witness" / "leaderboard-tokens.json"
TOKEN_ENV = "WITNESS_LEADERBOARD_TOKEN"


class LeaderboardError(Exception):
    """The server refused a request; the message is the server's."""


def connect(url: str, token: str | None = None, timeout: float = 600.0) -> httpx.Client:
    """An HTTP client for the leaderboard at ``url`` (with the API token, if any)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)


def _ok(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise LeaderboardError(f"{resp.status_code}: {detail}")
    return resp.json()


def saved_token(url: str, path: Path = TOKENS) -> str | None:
    """The token for ``url``: $WITNESS_LEADERBOARD_TOKEN, else the one ``witness leaderboard register`` saved."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    try:
        return json.loads(path.read_text()).get(url.rstrip("/"))
    except (OSError, ValueError, AttributeError):
        return None


def save_token(url: str, token: str, path: Path = TOKENS) -> Path:
    """Keep a token (file mode 0600), keyed by server URL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tokens = json.loads(path.read_text())
    except (OSError, ValueError):
        tokens = {}
    tokens[url.rstrip("/")] = token
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tokens, f, indent=1)
    return path


def register(client: httpx.Client, name: str, public_key: str) -> dict:
    """Register a public key; the answer holds the API token."""
    return _ok(client.post("/api/accounts", json={"name": name, "public_key": public_key}))


def ticket(client: httpx.Client, track: str, info: dict | None = None) -> dict:
    """A run ticket: run id, the server's r, and the track's recipe. ``info``: title, description, code_url."""
    return _ok(client.post("/api/tickets", json={"track": track, **(info or {})}))


def describe(client: httpx.Client, run_id: int, info: dict) -> dict:
    """Set a run's title, description and code link (the owner's account only)."""
    return _ok(client.patch(f"/api/runs/{run_id}", json=info))


@dataclass(frozen=True)
class TicketedRun:
    """How a ticketed run trains: its checkpoints, threads, what it sends the server while it trains.

    ``stream``: send every signed head as it is signed (the server's record that the log was not
    rewritten since). ``online``: take online challenges from the leaderboard's beacon: every head
    streamed (every 10 steps, and at checkpoints) is answered with the server's signed statement,
    and the states it selects are kept in the bundle. ``lr_factor(step, steps)`` makes a dishonest
    trainer, for demonstrations and tests: it scales the learning rate in secret while the
    schedule's rate is logged, which the server's replay must catch.
    """

    checkpoint_every: int = 50
    threads: int | None = None
    stream: bool = True
    online: bool = False
    every: int | None = None  # online: a head every this many steps (default: OnlineSpec.for_steps's)
    lr_factor: Callable[[int, int], float] | None = None


def train_ticketed(client: httpx.Client, track: str, key, out: str | os.PathLike,  # noqa: ANN001 - key
                   how: TicketedRun | None = None, *, info: dict | None = None,
                   progress: bool = False) -> tuple[int, SignedTreeHead]:
    """Take a ticket for ``track`` and train its recipe with the recorder (``how``), streaming every
    head; ``info`` is the run's title, description and code link. Returns (run id, final head)."""
    import dataclasses

    from ..record import Commitments, Online, Recorder, SelfChecking, Training
    from ..task import build_task

    how = TicketedRun() if how is None else how
    checkpoint_every, threads, stream, lr_factor = how.checkpoint_every, how.threads, how.stream, how.lr_factor
    tk = ticket(client, track, info)
    method = tk.get("method")  # a contest track: the method the ticket names (its wheel installed here)
    task = build_task(method["task"], method["recipe"]) if method else build_task(tk["task"], tk["config"])
    from ..record.online import OnlineSpec

    witnessed = tk.get("witnessed")  # a witnessed track: drand draws, through the server's operator log
    link = None
    if how.online and stream and not method:  # (a contest run is certified at submission)
        link = LeaderboardWitnessed(client, tk["run_id"], witnessed) if witnessed else \
            LeaderboardBeacon(client, tk["run_id"])
    spec = None
    if link is not None:  # the track's least p, where it asks for more than the default's 99 % bound
        drand = witnessed["drand"]["chain"]["hash"] if witnessed else None
        spec = OnlineSpec.for_steps(task.config.steps, drand=drand, every=how.every)
        if tk.get("online_p") is not None and spec.p < tk["online_p"]:
            spec = OnlineSpec.for_steps(task.config.steps, p=float(tk["online_p"]), drand=drand, every=how.every)
    streamer = HeadStreamer(client, tk["run_id"], records=bool(witnessed)) if stream and (not link or witnessed) \
        else None
    rec = Recorder.create(task, out, key, r=bytes.fromhex(tk["r"]),
                          commit=Commitments(checkpoint_every=checkpoint_every, r_source="ticket"),
                          training=Training(threads=threads),
                          online=Online(beacon=link, spec=spec,
                                        on_head=streamer),
                          self_check=SelfChecking(enabled=lr_factor is None))  # a cheat would stop at its own self-check
    if lr_factor is None:
        return tk["run_id"], rec.train(progress)
    n = task.config.steps
    with rec.stopped_on_failure():
        for t in range(n):
            out_ = task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t) * lr_factor(t, n), rec.step_seed(t))
            rec.log_step(t, dataclasses.replace(out_, lr=rec.lr(t)))
        return tk["run_id"], rec.finish()


def write_evaluation(bundle_dir: str | os.PathLike, key, out: str | os.PathLike,  # noqa: ANN001 - key
                     progress: bool = False) -> Path:
    """Evaluate a finished run's final model and write the signed certificate a submission carries."""
    from ..commit.hashing import canonical_json
    from ..evals.evaluate import evaluate

    out = Path(out)
    out.write_bytes(canonical_json(evaluate(bundle_dir, key, progress=progress)) + b"\n")
    return out


class HeadStreamer:
    """The recorder's ``on_head`` callback: sends every signed head with a consistency proof (and, for a
    witnessed run, ``records``: the log's records it newly covers, which the server's workers replay)."""

    def __init__(self, client: httpx.Client, run_id: int, retries: int = 5, records: bool = False):
        self.client, self.run_id, self.retries, self.records = client, run_id, retries, records
        self.acked = 0  # size of the last head the server stamped

    def __call__(self, head: SignedTreeHead, log: RunLog) -> None:
        """Stream ``head`` (size n) with the proof that it extends the last acknowledged one."""
        body: dict = {"tree_head": head.to_json()}
        if self.acked == 0:
            body["manifest"] = log.lines[0].decode()
        else:
            body["consistency"] = [h.hex() for h in log.tree.consistency_proof(self.acked, head.size)]
            if self.records:
                body["records"] = [line.decode() for line in log.lines[self.acked:head.size]]
        for attempt in range(self.retries):
            try:
                _ok(self.client.post(f"/api/runs/{self.run_id}/heads", json=body))
                self.acked = head.size
                return
            except httpx.TransportError:
                if attempt == self.retries - 1:
                    raise
                time.sleep(2 ** attempt)


UPLOAD_RATE = 1e6  # bytes a second an upload is given at least, on top of a minute, before it is given up


class LeaderboardBeacon(BeaconClient):
    """The leaderboard's beacon as the recorder's link: each head goes to the run's head endpoint
    (which stamps its time and answers with the beacon's statement), so it is streamed once."""

    def __init__(self, client: httpx.Client, run_id: int):
        super().__init__(client)  # the beacon's key is the server's: fetched from /api/beacon/key
        self.run_id = run_id
        self.heads_path = f"/api/runs/{run_id}/heads"

    def body(self, head: SignedTreeHead, log: RunLog) -> dict:
        """The beacon's request, less the run's name (the endpoint names the run), with the records
        the head newly covers (the server's workers replay the selected steps against them)."""
        since = max(self.sent_size, 1)
        body = {k: v for k, v in super().body(head, log).items() if k != "run"}
        body["records"] = [line.decode() for line in log.lines[since:head.size]]
        return body

    def publish(self, kind: str, step: int, path: Path) -> None:
        """Upload what the trainer kept for a selected step (see ``publish_kept``)."""
        publish_kept(self, self.run_id, kind, step, path)

    @staticmethod
    def statement_of(answer: object) -> object:
        """The statement in the endpoint's answer."""
        return answer.get("statement") if isinstance(answer, dict) else None


def publish_kept(bounded: BoundedClient, run_id: int, kind: str, step: int, path: Path) -> None:
    """Upload what the trainer kept for a selected step: the state before it (``states``), its batch's
    samples (``samples``) or a window's chunk openings (``chunks``), so the server replays it while the
    run trains."""
    size = Path(path).stat().st_size  # streamed from the file, never held whole (a state can be GBs)
    resp = bounded._request("PUT", f"/api/runs/{run_id}/online/{kind}/{step}",
                            content=lambda: _file_chunks(path), patient=True,
                            deadline=max(bounded.deadline, 60 + size / UPLOAD_RATE),
                            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
    if resp.status_code == 409 and "came already" in resp.text:
        return  # sent before a retry or a crash: the server has it
    if resp.status_code >= 300:
        raise BeaconError(f"the leaderboard refused the {kind} of step {step}: {resp.status_code} {_detail(resp)}")


class LeaderboardWitnessed(OperatorLink):
    """A witnessed track's link: each head into the leaderboard's operator log (which its witnesses
    cosign), the round from the track's drand endpoint, and each settled window sent to the run's windows
    endpoint, whose draw then takes the uploads of the steps it selects. The heads and records themselves
    go to the run's head endpoint as they are signed (``HeadStreamer``)."""

    def __init__(self, client: httpx.Client, run_id: int, conf: dict):
        from ..beacon.drand import DrandClient
        from ..beacon.operator_link import OperatorClient
        from ..commit.drand import ChainInfo
        from ..commit.note import NoteKey

        super().__init__(OperatorClient(client, vkey=conf["operator"]),
                         DrandClient(conf["drand"]["url"], ChainInfo.from_json(conf["drand"]["chain"])))
        # the track's witnesses and quorum decide which of the operator's cosignatures count for this run
        self.keys = [NoteKey.parse(v) for v in conf["witnesses"]]
        self.operator.required = int(conf["quorum"])
        self.run_id = run_id

    def settle(self, pending, log: RunLog):  # noqa: ANN001, ANN201 - a PendingWindow; a WitnessedWindow
        """The window, once its round came, sent to the leaderboard before its steps are uploaded."""
        w = super().settle(pending, log)
        resp = self.operator._request("POST", f"/api/runs/{self.run_id}/windows", patient=True,
                                      json={"window": w.to_json()})
        if resp.status_code >= 300:
            raise BeaconError(f"the leaderboard refused the window closing at size {w.size}: {resp.status_code} "
                              f"{_detail(resp)}")
        return w

    def publish(self, kind: str, step: int, path: Path) -> None:
        """Upload what the trainer kept for a selected step (see ``publish_kept``)."""
        publish_kept(self.operator, self.run_id, kind, step, path)


def online_leave_out(bundle_dir: str | os.PathLike) -> frozenset[str]:
    """The checkpoints an online run need not submit: all but the initial and the final one and
    those that end a selected step (a verifier in tolerance mode compares with them); the server
    audits it from the states kept for its selected steps, and re-challenges start from those."""
    from ..bundle.layout import checkpoint_name
    from ..bundle.reader import open_bundle
    from ..verify.online import parse_statements, selected_by

    b = open_bundle(bundle_dir)
    if b.manifest.online is None or not b.complete:
        return frozenset()
    n = len(b.steps)
    keep = {0, n} | {t + 1 for t in selected_by(parse_statements(b), b.manifest.online["p"], n)}
    return frozenset(checkpoint_name(k) for k in b.checkpoint_steps() if k not in keep)


def submit(client: httpx.Client, bundle_dir: str | os.PathLike, evaluation: str | os.PathLike | None) -> dict:
    """Pack and upload a finished bundle with its evaluation certificate (streamed from a file; None for a
    contest run, which the server scores); an online run leaves out the checkpoints its audit does not need."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = pack(bundle_dir, Path(tmp) / "submission.tar", evaluation, online_leave_out(bundle_dir))
        with open(archive, "rb") as f:  # the ticket's r names the run: its track's upload limit applies
            return _ok(client.post("/api/submissions", params={"r": _ticket_r(bundle_dir)}, content=_chunks(f),
                                   headers={"Content-Type": "application/x-tar",
                                            "Content-Length": str(archive.stat().st_size)}))


def _ticket_r(bundle_dir: str | os.PathLike) -> str:
    """The r (hex) of a bundle's manifest, the first line of its log."""
    from ..commit.hashing import parse_canonical_json

    with open(Path(bundle_dir) / "log.jsonl", "rb") as f:
        return parse_canonical_json(f.readline(1 << 20).rstrip(b"\n"))["r"]


def _chunks(f, size: int = 1 << 20):  # noqa: ANN001 - a binary file
    while chunk := f.read(size):
        yield chunk


def _file_chunks(path: Path, size: int = 1 << 20):  # noqa: ANN202 - a generator of bytes
    """A file's bytes in chunks, the file closed at the end."""
    with open(path, "rb") as f:
        yield from _chunks(f, size)


def challenge(client: httpx.Client, run_id: int, count: int) -> dict:
    """Ask for ``count`` more replay challenges on a run."""
    return _ok(client.post(f"/api/runs/{run_id}/challenges", json={"count": count}))


def wait(client: httpx.Client, run_id: int, timeout: float = 600.0, poll: float = 0.5,
         until: tuple[str, ...] = ("certified", "rejected", "revoked")) -> dict:
    """Poll a run until its status is one of ``until``."""
    deadline = time.monotonic() + timeout
    while True:
        run = _ok(client.get(f"/api/runs/{run_id}"))
        if run["status"] in until or time.monotonic() > deadline:
            return run
        time.sleep(poll)


def wait_round(client: httpx.Client, run_id: int, job_id: int, timeout: float = 600.0, poll: float = 0.5) -> dict:
    """Poll a run's challenge history until the round of ``job_id`` is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        offset = 0
        while True:  # a page at a time
            page = _ok(client.get(f"/api/runs/{run_id}/challenges", params={"offset": offset}))
            for rnd in page:
                if rnd["job_id"] == job_id:
                    return rnd
            if not page:
                break
            offset += len(page)
        time.sleep(poll)
    raise LeaderboardError(f"no result for job {job_id} after {timeout:.0f} s")
