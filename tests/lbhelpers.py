"""Helpers for the leaderboard tests: servers on SQLite or PostgreSQL, and runs trained against them."""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from witness.commit.signing import generate_key, public_hex
from witness.leaderboard import client as C
from witness.leaderboard.service import Settings
from witness.leaderboard.tracks import parse_track

PG_URL = os.environ.get("WITNESS_TEST_PG_URL", "postgresql+psycopg://witness:witness@127.0.0.1:5432/witness_test")
QUICK = "quick=tiny:steps=20@accuracy+"


def fresh_postgres() -> str:
    """An empty schema in the test database (``scripts/services.sh`` starts the server)."""
    try:
        engine = create_engine(PG_URL)
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
        engine.dispose()
    except Exception as e:  # the suite needs the real server: say how to get it, do not skip
        pytest.fail(f"PostgreSQL at {PG_URL} is not reachable ({e}); run scripts/services.sh first")
    return PG_URL


S3_URL = os.environ.get("WITNESS_TEST_S3_URL", "http://127.0.0.1:8333")
# the identity scripts/services.sh gives the store (every request is signed with it)
S3_ENV = {"AWS_ENDPOINT_URL": S3_URL, "AWS_ACCESS_KEY_ID": os.environ.get("WITNESS_S3_ACCESS_KEY", "witness"),
          "AWS_SECRET_ACCESS_KEY": os.environ.get("WITNESS_S3_SECRET", "witness-s3-secret"),
          "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "witness-test"


def fresh_s3(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix in the test bucket of the object store (``scripts/services.sh`` starts SeaweedFS's
    S3 gateway; the suite needs it, it does not skip), with this process's environment pointing at it."""
    import time
    import uuid

    import boto3

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    deadline = time.monotonic() + 30
    while True:  # a gateway just started answers a moment after its port opens
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            break
        except Exception as e:  # noqa: BLE001 - whatever the client raises while the server starts
            if time.monotonic() > deadline:
                pytest.fail(f"the S3 store at {S3_URL} is not reachable ({e}); run scripts/services.sh first")
            time.sleep(0.5)
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"  # one bucket (a bucket is a collection of volumes), a prefix each


def unfinished_s3(store) -> list[str]:  # noqa: ANN001 - an S3Store
    """The bucket's unfinished multipart uploads and objects under the store's incoming/ prefix."""
    ups = store.s3.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "incoming/").get("Uploads", [])
    return [u["Key"] for u in ups] + [k for k, _ in store.keys("incoming/")]


def tar_bytes(files: dict[str, bytes]) -> bytes:
    """A tar archive of regular files, by name, in the order given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_settings(backend: str, tmp: Path, **kw) -> Settings:
    """Settings for a fresh leaderboard on ``backend`` (sqlite or postgresql) with the quick track."""
    url = fresh_postgres() if backend == "postgresql" else f"sqlite:///{tmp / 'lb.db'}"
    kw.setdefault("tracks", (parse_track(QUICK),))
    return Settings(db_url=url, store=tmp / "store", **kw)


@dataclasses.dataclass
class Trainer:
    """A registered submitter: key, token and an HTTP client that sends the token."""

    name: str
    key: object
    token: str
    client: httpx.Client


def register(client: httpx.Client, name: str, key=None) -> Trainer:
    """Register ``name`` through ``client`` (a TestClient or an httpx client)."""
    key = key or generate_key()
    token = C.register(client, name, public_hex(key.public_key()))["token"]
    return Trainer(name, key, token, client)


class Authed:
    """A view of a shared client that sends one trainer's token (TestClient is not thread-safe to mutate)."""

    def __init__(self, client: httpx.Client, token: str):
        self.client, self.headers = client, {"Authorization": f"Bearer {token}"}

    def post(self, url: str, **kw):
        """POST with the token."""
        return self.client.post(url, headers=self.headers | kw.pop("headers", {}), **kw)

    def get(self, url: str, **kw):
        """GET with the token."""
        return self.client.get(url, headers=self.headers, **kw)

    def put(self, url: str, **kw):
        """PUT with the token."""
        return self.client.put(url, headers=self.headers | kw.pop("headers", {}), **kw)

    def stream(self, method: str, url: str, **kw):
        """A streamed request with the token (as httpx.Client.stream)."""
        return self.client.stream(method, url, headers=self.headers | kw.pop("headers", {}), **kw)

    @property
    def base_url(self):
        """The shared client's base URL."""
        return self.client.base_url


def train_and_certify(client, trainer: Trainer, out: Path, track: str = "quick", *, lr_cheat: dict | None = None,
                      key=None, stream: bool = True, checkpoint_every: int = 5) -> tuple[int, Path, Path]:
    """Ticket, train (streaming heads), evaluate; returns (run id, bundle, certificate). Not submitted.

    ``lr_cheat`` maps steps to a learning-rate factor applied in secret (the schedule's rate is logged).
    """
    key = key or trainer.key
    factor = (lambda t, n: lr_cheat.get(t, 1.0)) if lr_cheat else None
    run_id, _ = C.train_ticketed(Authed(client, trainer.token), track, key, out,
                                 C.TicketedRun(checkpoint_every=checkpoint_every, stream=stream, lr_factor=factor))
    return run_id, out, C.write_evaluation(out, key, out.with_suffix(".eval.json"))


def submit(client, trainer: Trainer, bundle: Path, cert: Path) -> dict:
    """Upload; returns the server's answer (raises ``LeaderboardError`` on a refusal)."""
    return C.submit(Authed(client, trainer.token), bundle, cert)



ONLINE_ALL = "all=tiny:steps=20,online=1.0@accuracy+"  # p = 1: every step is selected (deterministic tests)


def online_recorder(client, trainer: Trainer, track: str, out: Path, link=C.LeaderboardBeacon, p: float = 1.0):
    """A recorder on a ticket of ``track`` that takes online challenges from the leaderboard (``link``
    may be a subclass of the leaderboard's beacon link that misbehaves)."""
    from witness.record import Commitments, Online, Recorder, SelfChecking
    from witness.record.online import OnlineSpec
    from witness.task import build_task

    a = Authed(client, trainer.token)
    tk = C.ticket(a, track)
    task = build_task(tk["task"], tk["config"])
    return Recorder.create(task, out, trainer.key, r=bytes.fromhex(tk["r"]),
                           commit=Commitments(checkpoint_every=5, r_source="ticket"),
                           online=Online(beacon=link(a, tk["run_id"]),
                                         spec=OnlineSpec.for_steps(task.config.steps, p=p)),
                           self_check=SelfChecking(enabled=False))  # some of these trainers cheat


def train_steps(rec, steps, factor=lambda t: 1.0) -> None:  # noqa: ANN001 - a Recorder
    """Train ``steps`` with the recorder, the learning rate scaled in secret by ``factor(t)`` (the
    schedule's rate is logged)."""
    for t in steps:
        out = rec.task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t) * factor(t), rec.step_seed(t))
        rec.log_step(t, dataclasses.replace(out, lr=rec.lr(t)))


class WithholdingBeacon(C.LeaderboardBeacon):
    """Uploads no samples for the selected steps from ``WITHHOLD_FROM`` on: those stay selected,
    awaiting their state, whatever happens to the run."""

    WITHHOLD_FROM = 8

    def publish(self, kind: str, step: int, path: Path) -> None:
        """Upload, except the samples of the withheld steps."""
        if kind == "samples" and step >= self.WITHHOLD_FROM:
            return
        super().publish(kind, step, path)


def rejected_online_run(client, trainer: Trainer, lb, out: Path, track: str = "all") -> int:  # noqa: ANN001 - a Leaderboard
    """A run rejected while it trained (steps 6.. trained with a secretly larger learning rate), whose
    selected steps 8 and 9 never got their samples: returns its id."""
    from witness.leaderboard.worker import work

    rec = online_recorder(client, trainer, track, out, link=WithholdingBeacon)
    train_steps(rec, range(12), lambda t: 3.0 if t >= 6 else 1.0)
    rec.online.wait()  # heads to step 10's checkpoint answered: states of 0..9 up, samples of 0..7
    work(lb, once=True)  # the server's worker replays what is ready, and step 6 fails
    run_id = rec.online.link.run_id
    rec.online.close()
    return run_id
