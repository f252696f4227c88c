"""The leaderboard on an S3-compatible object store (a real one: SeaweedFS's S3 gateway, which
scripts/services.sh starts on loopback), with a worker in another process that shares nothing with
the server but PostgreSQL and the object store."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from lbhelpers import QUICK, fresh_postgres, register, submit, train_and_certify

from witness.leaderboard.app import create_app
from witness.leaderboard.service import Leaderboard, Settings
from witness.leaderboard.store import archive_key
from witness.leaderboard.tracks import parse_track

S3_URL = os.environ.get("WITNESS_TEST_S3_URL", "http://127.0.0.1:8333")
S3_ENV = {"AWS_ENDPOINT_URL": S3_URL, "AWS_ACCESS_KEY_ID": "witness", "AWS_SECRET_ACCESS_KEY": "witness",
          "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "witness-test"


@pytest.fixture
def s3(monkeypatch):
    """A fresh prefix in the test bucket of the object store (the suite needs the real server: it does
    not skip)."""
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    import boto3

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
    yield f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"  # one bucket (a bucket is a collection of volumes), a prefix each


def test_the_s3_store_round_trips_a_multipart_file_and_lists_and_deletes(s3, tmp_path):
    from boto3.s3.transfer import TransferConfig

    from witness.leaderboard.s3store import S3Store

    store = S3Store(s3, tmp_path / "work")
    store.transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)  # S3's smallest part
    data = os.urandom(12 << 20)  # three parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.put("runs/7/submission.tar", src)
    assert not src.exists()  # consumed
    assert store.exists("runs/7/submission.tar") and not store.exists("runs/8/submission.tar")
    assert store.sha256("runs/7/submission.tar") == hashlib.sha256(data).hexdigest()
    got = store.fetch("runs/7/submission.tar", tmp_path / "back.bin")
    assert got.read_bytes() == data
    assert [k for k, _ in store.keys("runs/")] == ["runs/7/submission.tar"]
    store.delete("runs/7/submission.tar")
    assert not store.exists("runs/7/submission.tar") and list(store.keys("runs/")) == []
    with pytest.raises(FileNotFoundError):
        store.fetch("runs/7/submission.tar", tmp_path / "gone.bin")


def test_a_worker_elsewhere_certifies_a_run_through_postgres_and_the_object_store(s3, tmp_path):
    db = fresh_postgres()
    key = tmp_path / "server_key.pem"
    settings = Settings(db_url=db, store=s3, work=tmp_path / "server-work", tracks=(parse_track(QUICK),),
                        server_key=key)
    lb = Leaderboard(settings)
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        run_id, bundle, cert = train_and_certify(tc, alice, tmp_path / "run")
        assert submit(tc, alice, bundle, cert)["status"] == "pending"
        assert lb.store.exists(archive_key(run_id))  # the submission is an object in the bucket
        # a worker on "another machine": its own working folder, the database and the bucket only
        worker_work = tmp_path / "worker-work"
        out = subprocess.run(
            [sys.executable, "-m", "witness.cli", "leaderboard", "worker", "--db", db, "--store", s3,
             "--work", str(worker_work), "--server-key", str(key), "--track", QUICK, "--once"],
            env=os.environ | S3_ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "1 job(s) done" in out.stdout, out.stderr[-3000:]
        r = tc.get(f"/api/runs/{run_id}").json()
        assert r["status"] == "certified", r
        assert (worker_work / "cache" / str(run_id) / "bundle" / "log.jsonl").is_file()  # fetched and unpacked there
        # the pages serve the objects from the store, streamed through the server
        archive = tc.get(f"/runs/{run_id}/download/submission.tar")
        assert archive.status_code == 200 and hashlib.sha256(archive.content).hexdigest() == r["bundle_sha256"]
        model = tc.get(f"/runs/{run_id}/download/model.safetensors")
        assert model.status_code == 200 and len(model.content) > 0
        assert tc.get(f"/runs/{run_id}/plots/loss.svg").text.startswith("<?xml")
        decision = json.loads(base64.b64decode(tc.get(f"/api/runs/{run_id}/certification").json()["payload"]))
        # the signed decision names that file, by the SHA-256 the worker stored with it
        assert decision["subject"][0]["digest"]["sha256"] == hashlib.sha256(model.content).hexdigest()
    lb.engine.dispose()
