"""The object store is authenticated (scripts/services.sh starts SeaweedFS's S3 gateway with one
identity): an unsigned request, an anonymous listing, an edited presigned link and an expired one
are each refused by the store, and a presigned link reaches its own object only, never another
run's or an upload still in progress."""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from lbhelpers import BUCKET, S3_URL, fresh_s3

from witness.store.s3 import S3Store


@pytest.fixture
def store(monkeypatch, tmp_path):
    s = S3Store(fresh_s3(monkeypatch), tmp_path / "work", presign_endpoint=S3_URL)
    for run, data in (("1", b"run one's bundle"), ("2", b"run two's secret bundle")):
        (tmp_path / run).write_bytes(data)
        s.put(f"runs/{run}/bundle.tar", tmp_path / run)
    return s


def _link(store: S3Store, key: str) -> str:
    resp = store.response(key, filename="bundle.tar", redirect=True)
    assert resp.status_code == 307
    return resp.headers["location"]


def test_a_presigned_link_reads_its_own_object(store):
    r = httpx.get(_link(store, "runs/1/bundle.tar"))
    assert r.status_code == 200 and r.content == b"run one's bundle"


def test_an_edited_presigned_link_is_refused(store):
    url = _link(store, "runs/1/bundle.tar")
    other = url.replace("/runs/1/", "/runs/2/")
    assert other != url
    r = httpx.get(other)
    assert r.status_code == 403 and b"secret" not in r.content
    parts = urlsplit(url)  # its signature edited
    query = "&".join(p if not p.startswith("X-Amz-Signature=") else "X-Amz-Signature=" + "0" * 64
                     for p in parts.query.split("&"))
    assert httpx.get(urlunsplit(parts._replace(query=query))).status_code == 403


def test_an_expired_presigned_link_is_refused(store):
    # the link's time is signed to the second (X-Amz-Date): a 1 s link signed late in a second was already
    # expired when first used (a flaky failure); 5 s is valid at once, and expired 7 s later
    url = store.presigner.generate_presigned_url(
        "get_object", Params={"Bucket": store.bucket, "Key": store._key("runs/1/bundle.tar")}, ExpiresIn=5)
    assert httpx.get(url).status_code == 200
    time.sleep(7)
    assert httpx.get(url).status_code == 403


def test_unsigned_requests_and_anonymous_listings_are_refused(store):
    plain = f"{S3_URL}/{BUCKET}/{store._key('runs/1/bundle.tar')}"
    assert httpx.get(plain).status_code == 403
    for listing in (f"{S3_URL}/", f"{S3_URL}/{BUCKET}", f"{S3_URL}/{BUCKET}?list-type=2",
                    f"{S3_URL}/{BUCKET}?uploads"):
        r = httpx.get(listing)
        assert r.status_code == 403, (listing, r.status_code)
        assert b"runs/" not in r.content
    assert httpx.put(f"{S3_URL}/{BUCKET}/{store._key('runs/3/x')}", content=b"x").status_code == 403


def test_a_presigned_link_never_reaches_an_upload_in_progress(store):
    s3 = store.s3
    key = store._key("incoming/upload-in-progress")
    up = s3.create_multipart_upload(Bucket=store.bucket, Key=key)
    try:
        s3.upload_part(Bucket=store.bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"half a bundle")
        link = _link(store, "runs/1/bundle.tar")
        r = httpx.get(link.replace(store._key("runs/1/bundle.tar"), key))  # the key swapped in: refused
        assert r.status_code == 403 and b"half" not in r.content
        # even a link signed for that key finds no object: an unfinished upload is no object yet
        r = httpx.get(_link(store, "incoming/upload-in-progress"))
        assert r.status_code == 404 and b"half" not in r.content
    finally:
        s3.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=up["UploadId"])
