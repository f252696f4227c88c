"""A leaderboard's objects in an S3-compatible object store, through boto3.

``--store s3://bucket/prefix``: the endpoint and credentials come from the environment as boto3
reads them (``AWS_ENDPOINT_URL`` for a store that is not AWS's, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``). Files go up in multipart uploads of 16 MB parts
and come down streamed (four parts in flight), so neither side holds a whole bundle in memory; an
object's SHA-256 is kept in its metadata (the signed decision names the released model by it). The
bucket is created if it is missing. Every server and worker that shares the bucket and the database
shares the leaderboard.

An upload to the server goes into the bucket as it arrives: a multipart upload under
``incoming/``, one part at a time, while the server unpacks the archive in the same pass to check it.
Kept, it is copied inside the store to its key (no byte comes back through the server) and the
incoming object removed; refused, it is removed; cut off by a crash, the next start aborts it.

With ``presign_endpoint`` set, downloads are redirects to presigned URLs on that endpoint (the
store as the readers reach it), so that the bytes of a model or a submission do not pass through the
server; without it they are streamed through the server, which suits a store on a private network.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..bundle.checkpoint import file_sha256
from .base import Sink, Store, Upload

PART = 16 * 1024 * 1024  # x4 in flight: about 64 MB of a transfer in memory at once
PRESIGN_S = 15 * 60  # how long a download link is good for
INCOMING = "incoming/"


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``; this process's working folder is ``work``."""

    def __init__(self, url: str, work: Path, presign_endpoint: str | None = None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"an S3 store is s3://BUCKET[/PREFIX], not {url!r}")
        self.url, self.bucket, self.prefix = url, bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.s3 = boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"},
                                                   s3={"addressing_style": "path"}))
        self.transfer = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=4)
        self.part = PART
        # presigned URLs are signed for the host the reader will ask, which may not be the server's
        self.presigner = None if presign_endpoint is None else boto3.client(
            "s3", endpoint_url=presign_endpoint or None,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
        self._work(work)
        try:
            self.s3.head_bucket(Bucket=bucket)
        except self.s3.exceptions.ClientError:
            try:
                self.s3.create_bucket(Bucket=bucket)
            except (self.s3.exceptions.BucketAlreadyOwnedByYou, self.s3.exceptions.BucketAlreadyExists):
                pass  # another server or worker made it meanwhile

    def _key(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"not a key: {key!r}")
        return self.prefix + key

    def put(self, key: str, path: Path) -> None:
        """A multipart upload of the file (then removed), its SHA-256 in the metadata."""
        self.s3.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer,
                            ExtraArgs={"Metadata": {"sha256": file_sha256(path).hex()}})
        Path(path).unlink(missing_ok=True)

    def fetch(self, key: str, dest: Path) -> Path:
        """A streamed download to ``dest``."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        try:
            self.s3.download_file(self.bucket, self._key(key), str(tmp), Config=self.transfer)
        except self.s3.exceptions.ClientError as e:
            tmp.unlink(missing_ok=True)
            raise FileNotFoundError(f"the store holds no {key}: {e}") from None
        os.replace(tmp, dest)
        return dest

    def _head(self, key: str) -> dict | None:
        try:
            return self.s3.head_object(Bucket=self.bucket, Key=self._key(key))
        except self.s3.exceptions.ClientError:
            return None

    def exists(self, key: str) -> bool:
        """A HEAD request."""
        return self._head(key) is not None

    def sha256(self, key: str) -> str:
        """From the object's metadata, written when it was stored."""
        head = self._head(key)
        if head is None or "sha256" not in head.get("Metadata", {}):
            raise FileNotFoundError(f"the store holds no {key} with a recorded SHA-256")
        return head["Metadata"]["sha256"]

    def response(self, key: str, filename: str | None = None, media_type: str | None = None,
                 redirect: bool = False) -> Any:  # noqa: ANN401
        """The object streamed through the server in 1 MB pieces (the store need not be reachable
        from the reader), or with ``redirect`` and a presigning endpoint a redirect to a presigned URL."""
        from fastapi.responses import RedirectResponse, StreamingResponse

        if redirect and self.presigner is not None:
            params = {"Bucket": self.bucket, "Key": self._key(key)}
            if filename:
                params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
            if media_type:
                params["ResponseContentType"] = media_type
            url = self.presigner.generate_presigned_url("get_object", Params=params, ExpiresIn=PRESIGN_S)
            return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})

        obj = self.s3.get_object(Bucket=self.bucket, Key=self._key(key))
        headers = {"Content-Length": str(obj["ContentLength"])}
        if filename:
            headers["Content-Disposition"] = f'attachment; filename="{filename}"'
        body = obj["Body"]

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(1 << 20)
            finally:
                body.close()

        return StreamingResponse(chunks(), media_type=media_type or "application/octet-stream", headers=headers)

    def keys(self, prefix: str) -> Iterator[tuple[str, float]]:
        """A paged listing."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][len(self.prefix):], obj["LastModified"].timestamp()

    def delete(self, key: str) -> None:
        """Remove the object."""
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))

    # --- uploads ---------------------------------------------------------------------
    def _sink(self) -> Sink:
        """A multipart upload under ``incoming/`` in the bucket."""
        return S3Sink(self, f"{INCOMING}upload-{os.getpid()}-{os.urandom(8).hex()}.tar")

    def keep(self, upload: Upload, key: str) -> None:
        """Copied inside the store (a multipart copy where it is large), its SHA-256 in the metadata;
        the incoming object removed."""
        if upload.ref is None:
            raise ValueError("the upload was kept or dropped already")
        self.s3.copy({"Bucket": self.bucket, "Key": self._key(upload.ref)}, self.bucket, self._key(key),
                     ExtraArgs={"Metadata": {"sha256": upload.sha256}, "MetadataDirective": "REPLACE"},
                     Config=self.transfer)
        self._drop(upload.ref)
        upload.ref = None

    def _drop(self, ref: str) -> None:
        self.delete(ref)

    def sweep_incoming(self, older_than_s: float) -> int:
        """The working folder's leftovers, the bucket's ``incoming/`` objects and its unfinished
        multipart uploads there, of ``older_than_s`` or more (a server that shares the bucket has
        its uploads in flight younger than that)."""
        removed = super().sweep_incoming(older_than_s)
        now = time.time()
        for key, modified in list(self.keys(INCOMING)):
            if now - modified >= older_than_s:
                self.delete(key)
                removed += 1
        pages = self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                          Prefix=self._key(INCOMING))
        for page in pages:
            for up in page.get("Uploads", []):
                if now - up["Initiated"].timestamp() >= older_than_s:
                    self.s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    removed += 1
        return removed


class S3Sink(Sink):
    """An upload going into the bucket as it arrives: parts of ``store.part`` bytes, one being sent
    while the next is received (two parts in memory at most)."""

    def __init__(self, store: S3Store, ref: str):
        self.store, self.ref = store, ref
        self.key = store._key(ref)
        self.upload_id: str | None = None
        self.buf = bytearray()
        self.parts: list[dict] = []
        self.sending: asyncio.Future | None = None
        self.aborted = False

    async def _send(self, data: bytes) -> None:
        s3, number = self.store.s3, len(self.parts) + 1
        if self.sending is not None:
            await self.sending
        await self._begin()
        self.parts.append({"PartNumber": number})

        def send() -> None:
            got = s3.upload_part(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                 PartNumber=number, Body=data)
            self.parts[number - 1]["ETag"] = got["ETag"]

        self.sending = asyncio.ensure_future(asyncio.to_thread(send))

    async def _begin(self) -> None:
        # at the first byte: an upload cut off by a crash is then in the bucket's list of unfinished
        # multipart uploads, which the next start aborts
        if self.upload_id is None and not self.aborted:
            made = await asyncio.to_thread(self.store.s3.create_multipart_upload, Bucket=self.store.bucket,
                                           Key=self.key)
            self.upload_id = made["UploadId"]

    async def write(self, data: bytes) -> None:
        """Buffered; a full part is sent."""
        await self._begin()
        self.buf += data
        while len(self.buf) >= self.store.part:
            piece = bytes(self.buf[: self.store.part])
            del self.buf[: self.store.part]
            await self._send(piece)

    async def close(self) -> None:
        """The last part sent and the upload completed."""
        await self._send(bytes(self.buf))
        self.buf = bytearray()
        await self.sending
        self.sending = None
        await asyncio.to_thread(self.store.s3.complete_multipart_upload, Bucket=self.store.bucket, Key=self.key,
                                UploadId=self.upload_id, MultipartUpload={"Parts": self.parts})

    def abort(self) -> None:
        """The multipart upload aborted (or, completed already, the object removed)."""
        if self.aborted:
            return
        self.aborted = True
        if self.sending is not None:
            if not self.sending.done():
                self.sending.cancel()  # the thread finishes its part; the abort below discards it
            elif not self.sending.cancelled():
                self.sending.exception()  # seen: a part that failed is what aborts it, not a log line
        s3, upload_id, self.upload_id = self.store.s3, self.upload_id, None
        try:
            if upload_id is not None:
                s3.abort_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=upload_id)
            s3.delete_object(Bucket=self.store.bucket, Key=self.key)
        except s3.exceptions.ClientError:
            pass  # what a start's sweep removes
