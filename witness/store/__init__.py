"""Object stores, below the servers that keep objects in them (the leaderboard, and a beacon that
would): the interface (``Store``, ``Upload``, ``Sink``), ``LocalStore``, ``S3Store`` (``s3``, imported
where it is named: it imports boto3), a submission's archive, and the names of a run's objects."""

from __future__ import annotations

import os
from pathlib import Path

from .archive import MAX_MEMBERS, MAX_TAR_META, StreamUnpacker, pack
from .base import (
    DEFAULT_MAX_UPLOAD,
    MAX_UNPACKED,
    FileSink,
    Sink,
    Store,
    Upload,
    UploadTooLarge,
    is_older,
    link_or_copy,
    remove_path,
)
from .keys import (
    EVALUATION,
    archive_key,
    evaluation_key,
    model_key,
    online_key,
    online_prefix,
    plot_key,
)
from .local import LocalStore

__all__ = ["DEFAULT_MAX_UPLOAD", "EVALUATION", "MAX_MEMBERS", "MAX_TAR_META", "MAX_UNPACKED", "FileSink", "LocalStore",
           "Sink", "Store", "StreamUnpacker", "Upload", "UploadTooLarge", "archive_key", "evaluation_key",
           "is_older", "link_or_copy", "model_key", "online_key", "online_prefix", "open_store", "pack",
           "plot_key", "remove_path"]


def open_store(spec: str | os.PathLike, work: str | os.PathLike | None = None,
               presign_endpoint: str | None = None, cache_bytes: int | None = None) -> Store:
    """The store a ``--store`` names: a folder (``LocalStore``), or ``s3://bucket[/prefix]``
    (``S3Store``, endpoint and credentials from the environment, working folder ``work``, downloads
    presigned for ``presign_endpoint`` where it is given, at most ``cache_bytes`` of unpacked bundles
    kept in ``work``)."""
    text = str(spec)
    if text.startswith("s3://"):
        from .s3 import S3Store

        if work is None:
            raise ValueError("an s3:// store needs a local working folder (--work DIR)")
        store = S3Store(text, Path(work), presign_endpoint)
        store.cache_bytes = cache_bytes
        return store
    if presign_endpoint is not None:
        raise ValueError("presigned downloads need an s3:// store")
    if cache_bytes is not None:
        raise ValueError("a bound on unpacked bundles needs an s3:// store (a local store's are its own copy)")
    return LocalStore(Path(spec))
