"""A leaderboard's objects in an S3-compatible object store, through boto3.

``--store s3://bucket/prefix``: the endpoint and credentials come from the environment as boto3
reads them (``AWS_ENDPOINT_URL`` for a store that is not AWS's, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``). Files go up in multipart uploads of 64 MB parts
and come down streamed (four 16 MB parts in flight), so neither side holds a whole bundle in memory; an object's SHA-256 is kept
in its metadata (the signed decision names the released model by it). The bucket is created if it
is missing. Every server and worker that shares the bucket and the database shares the leaderboard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..bundle.checkpoint import file_sha256
from .store import Store

PART = 16 * 1024 * 1024  # x4 in flight: about 64 MB of a transfer in memory at once


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``; this process's working folder is ``work``."""

    def __init__(self, url: str, work: Path):
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

    def response(self, key: str, filename: str | None = None, media_type: str | None = None) -> Any:  # noqa: ANN401
        """The object streamed through the server in 1 MB pieces (the store need not be reachable
        from the reader)."""
        from fastapi.responses import StreamingResponse

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
