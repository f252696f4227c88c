"""The store of a server's objects, and uploads: streamed into the store's incoming area as they
arrive, under a size limit, and (a submission) unpacked strictly in the same pass. ``Store`` is the
interface with what every store shares; ``LocalStore`` (``local``) keeps objects in a folder,
``S3Store`` (``s3``) in an S3-compatible object store."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MalformedInput
from .archive import StreamUnpacker, _unpack
from .keys import EVALUATION, archive_key, evaluation_key

DEFAULT_MAX_UPLOAD = 512 * 1024 * 1024
MAX_UNPACKED = 1 << 44  # a bundle fetched back from the store was bounded when it was taken


class UploadTooLarge(MalformedInput):
    """The upload is over the server's limit."""


class Store:
    """Where a leaderboard keeps its objects (submissions, models, plots, online uploads), and the
    local working folder ``root`` of this process: uploads being received (``incoming/``), unpacked
    bundles, leaves files. ``LocalStore`` keeps the objects in that folder too; ``S3Store`` in an
    S3-compatible object store, which workers on other machines share."""

    root: Path

    def _work(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "incoming").mkdir(parents=True, exist_ok=True)

    # --- objects (implemented by each store) --------------------------------------------
    def put(self, key: str, path: Path) -> None:
        """Store the local file ``path`` as ``key`` (the file is consumed)."""
        raise NotImplementedError

    def fetch(self, key: str, dest: Path) -> Path:
        """A local file holding ``key``'s bytes at ``dest`` (a link to it where the store is local)."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        """Whether the store holds ``key``."""
        raise NotImplementedError

    def sha256(self, key: str) -> str:
        """The SHA-256 (hex) of ``key``'s bytes."""
        raise NotImplementedError

    def response(self, key: str, filename: str | None = None, media_type: str | None = None,
                 redirect: bool = False) -> Any:  # noqa: ANN401
        """An HTTP response serving ``key``, streamed from the store; with ``redirect``, where the
        store can, a redirect to a link the reader downloads it from directly."""
        raise NotImplementedError

    def keys(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, modified, as a Unix time) of every object under ``prefix``."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is not there)."""
        raise NotImplementedError

    def local_bundle_root(self, run_id: int) -> Path:
        """Where this process keeps the run's unpacked bundle."""
        return self.root / "cache" / str(int(run_id))

    # The unpacked bundles of a working folder are a cache of the store's archives: with a bound,
    # the least recently used go once the folder holds more than ``cache_bytes`` (never one that a
    # worker of this machine is using: it holds a shared lock on it). None: no bound (the local
    # store, whose unpacked bundles are its own copy).
    cache_bytes: int | None = None

    # --- shared ---------------------------------------------------------------------
    def bundle_dir(self, run_id: int) -> Path:
        """The run's unpacked bundle on this machine: kept since the submission, or fetched from the
        store and unpacked again, strictly (a worker on another machine)."""
        d = self.local_bundle_root(run_id) / "bundle"
        if not d.is_dir():
            tmp = self.root / "incoming" / f"fetch-{int(run_id)}-{os.getpid()}.tar"
            try:
                self.fetch(archive_key(run_id), tmp)
                staging = self.unpack(tmp, MAX_UNPACKED)
                d.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.replace(staging / "bundle", d)
                except OSError:  # another worker of this machine was quicker
                    pass
                shutil.rmtree(staging, ignore_errors=True)
            finally:
                tmp.unlink(missing_ok=True)
            self.evict(keep=run_id)
        elif self.cache_bytes is not None:
            os.utime(d.parent)  # used now: the last to go
        return d

    def _lock(self, run_id: int) -> Path:
        return self.root / "cache" / f"{int(run_id)}.lock"

    @contextlib.contextmanager
    def keep_bundle(self, run_id: int) -> Iterator[None]:
        """While in this block, the run's unpacked bundle here is not evicted (a shared lock that
        other processes of this machine see)."""
        if self.cache_bytes is None:
            yield
            return
        lock = self._lock(run_id)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            yield

    def evict(self, keep: int | None = None) -> int:
        """Remove the least recently used unpacked bundles that no process here is using until the
        cache is within its bound (``keep``'s stays); the bytes removed."""
        if self.cache_bytes is None:
            return 0
        cache = self.root / "cache"
        entries = sorted((p.stat().st_mtime, p) for p in cache.iterdir() if p.name.isdigit() and p.is_dir())
        sizes = {p: _tree_bytes(p) for _, p in entries}
        total, removed = sum(sizes.values()), 0
        for _, p in entries:
            if total <= self.cache_bytes:
                break
            if keep is not None and p.name == str(int(keep)):
                continue
            with open(self._lock(int(p.name)), "a+b") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a worker of this machine is using it
                shutil.rmtree(p, ignore_errors=True)
            total -= sizes[p]
            removed += sizes[p]
        return removed

    def leaves_file(self, data_root: str) -> Path:
        """Where a track's dataset leaves are kept once written (named by the data root they commit)."""
        return self.root / "leaves" / f"{data_root}.leaves"

    def scratch(self, name: str) -> Path:
        """A fresh local path in the working folder for a file about to be stored."""
        return self.root / "incoming" / f"put-{os.getpid()}-{os.urandom(6).hex()}-{name}"

    # --- uploads ---------------------------------------------------------------------
    def _sink(self) -> Sink:
        """Where an upload's bytes go as they arrive (each store's incoming area)."""
        raise NotImplementedError

    def keep(self, upload: Upload, key: str) -> None:
        """Store a received upload's bytes as ``key`` (before the commit that names it)."""
        raise NotImplementedError

    async def receive(self, chunks: AsyncIterator[bytes], limit: int, unpack_limit: int | None = None) -> Upload:
        """Stream an upload into the store's incoming area as it arrives, stopping at ``limit`` bytes;
        with ``unpack_limit``, unpack it strictly here in the same pass (a submission), so that it is
        checked when its last byte has arrived and the store holds it already."""
        sink = self._sink()
        unpacker = StreamUnpacker(self.root / "incoming", unpack_limit) if unpack_limit is not None else None
        digest, size, bad = hashlib.sha256(), 0, None
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise UploadTooLarge(f"the upload is over the server's limit of {limit} bytes")
                if bad is not None:
                    continue  # read to the end, storing nothing, so that the client gets the answer
                digest.update(chunk)
                await sink.write(chunk)
                if unpacker is not None:
                    try:
                        await unpacker.feed(chunk)
                    except MalformedInput as e:  # found bad before the end: stop storing it
                        bad = e
                        sink.abort()
            if bad is not None:
                raise bad
            await sink.close()
            staging = await unpacker.finish() if unpacker is not None else None
        except BaseException:
            sink.abort()
            if unpacker is not None:
                unpacker.abort()
            raise
        return Upload(digest.hexdigest(), size, sink.ref, staging)

    def unpack(self, archive: Path, limit: int) -> Path:
        """Unpack a submission into a fresh staging folder; raise ``MalformedInput`` on anything odd."""
        staging = Path(str(archive) + ".d")
        staging.mkdir()
        try:
            _unpack(archive, staging, limit)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def accept(self, run_id: int, upload: Upload) -> None:
        """Store a checked submission (before the commit that names it): the archive and its
        evaluation as objects, the unpacked bundle kept here for the workers of this machine."""
        staging = upload.staging
        if staging is None:
            raise ValueError("a submission is received unpacked")
        local = self.local_bundle_root(run_id)  # a local store keeps its objects beside the bundle
        if (local / "bundle").exists():
            shutil.rmtree(local / "bundle")
        local.mkdir(parents=True, exist_ok=True)
        if (staging / EVALUATION).exists():
            self.put(evaluation_key(run_id), staging / EVALUATION)
        os.replace(staging / "bundle", local / "bundle")
        shutil.rmtree(staging)
        upload.staging = None
        self.keep(upload, archive_key(run_id))
        self.evict(keep=run_id)

    def drop(self, upload: Upload) -> None:
        """Remove what is left of an upload that was refused (or kept: then nothing is left)."""
        if upload.staging is not None:
            shutil.rmtree(upload.staging, ignore_errors=True)
            upload.staging = None
        if upload.ref is not None:
            self._drop(upload.ref)
            upload.ref = None

    def _drop(self, ref: str) -> None:
        Path(ref).unlink(missing_ok=True)

    def sweep_incoming(self, older_than_s: float) -> int:
        """Remove uploads that never became a submission, received ``older_than_s`` ago or more
        (a crash mid-upload); their number."""
        removed = 0
        for p in (self.root / "incoming").iterdir():
            if is_older(p, older_than_s):
                remove_path(p)
                removed += 1
        return removed


@dataclass
class Upload:
    """An upload received whole: where its bytes are in the store's incoming area (``ref``: a local
    path, or an object's key), their SHA-256 and size, and for a submission its bundle, unpacked and
    checked for names and sizes, in this machine's working folder."""

    sha256: str
    size: int
    ref: str | None
    staging: Path | None = None


class Sink:
    """An upload's bytes on their way into the store."""

    ref: str

    async def write(self, data: bytes) -> None:
        """Take the next piece."""
        raise NotImplementedError

    async def close(self) -> None:
        """The upload is whole."""
        raise NotImplementedError

    def abort(self) -> None:
        """The upload failed: remove what was written."""
        raise NotImplementedError


class FileSink(Sink):
    """A file in the working folder's ``incoming/``."""

    def __init__(self, folder: Path):
        fd, self.ref = _mkstemp(folder)
        self.f = os.fdopen(fd, "wb")

    async def write(self, data: bytes) -> None:
        """Appended to the file."""
        self.f.write(data)

    async def close(self) -> None:
        """Closed."""
        self.f.close()

    def abort(self) -> None:
        """Closed and removed."""
        self.f.close()
        Path(self.ref).unlink(missing_ok=True)


def link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where the file system allows it (the bundle reader refuses symbolic links), else a copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (as they are found: a concurrent removal is not an error)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def is_older(path: Path, bound_s: float) -> bool:
    """Whether ``path`` was last written ``bound_s`` seconds ago or more (False if it is gone)."""
    try:
        return time.time() - path.lstat().st_mtime >= bound_s
    except FileNotFoundError:
        return False


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree (never following a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _mkstemp(folder: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(dir=folder, prefix="upload-", suffix=".tar")
