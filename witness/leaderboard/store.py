"""The store of a leaderboard's objects (local disk, or S3), and uploads: streamed into the
store's incoming area as they arrive, under a size limit, and unpacked strictly in the same pass.

A submission is a tar archive (optionally gzip-compressed) holding ``bundle/…`` and
``evaluation.json``. Nothing in it is trusted: names are checked before a byte is written
(no absolute paths, no ``..``, no links or devices, only the expected top-level entries),
the unpacked size and file count are bounded, and files are written by this code, never by
``tarfile.extract``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from queue import Full, Queue  # the standard library's (not the leaderboard's job queue)
from typing import Any

from ..bundle.checkpoint import file_sha256
from ..errors import MalformedInput

DEFAULT_MAX_UPLOAD = 512 * 1024 * 1024
MAX_MEMBERS = 100_000
MAX_UNPACKED = 1 << 44  # a bundle fetched back from the store was bounded when it was taken
EVALUATION = "evaluation.json"


class UploadTooLarge(MalformedInput):
    """The upload is over the server's limit."""


# The objects a leaderboard keeps, by key. Each is written once, before the row that names it is
# committed (a crash in between leaves an object no row names, which the next start removes).
def archive_key(run_id: int) -> str:
    """The submission exactly as uploaded (served for download with its SHA-256)."""
    return f"runs/{int(run_id)}/submission.tar"


def evaluation_key(run_id: int) -> str:
    """The submission's evaluation certificate."""
    return f"runs/{int(run_id)}/{EVALUATION}"


def model_key(run_id: int) -> str:
    """The run's final model as released (written by a worker from the verified bundle)."""
    return f"runs/{int(run_id)}/model.safetensors"


def plot_key(run_id: int, name: str) -> str:
    """A plot drawn when the run was verified (``loss``, ``optimizer``, ``fingerprints``)."""
    return f"runs/{int(run_id)}/plots/{name}.svg"


def online_key(run_id: int, kind: str, step: int, sha256: str) -> str:
    """An online upload: the state before a selected step ("states") or its samples ("samples"),
    named by its SHA-256 too, so that an object is never replaced under the row that names it."""
    if kind not in ("states", "samples") or len(sha256) != 64:
        raise ValueError(f"not an online upload: {kind} {sha256}")
    return f"{online_prefix(run_id, kind)}{int(step):08d}.{sha256}.{'safetensors' if kind == 'states' else 'json'}"


def online_prefix(run_id: int, kind: str) -> str:
    """The keys of a run's online uploads of one kind start with this."""
    return f"online/{int(run_id)}/{kind}/"


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


class StreamUnpacker:
    """Unpacks an archive strictly (as ``Store.unpack``) while its bytes arrive, in a thread of its
    own fed through a bounded queue: a few MB of the upload in memory at most."""

    FEED = 1 << 20  # bytes handed to the thread at once
    DEPTH = 8  # pieces queued at most

    def __init__(self, folder: Path, limit: int):
        self.staging = Path(tempfile.mkdtemp(dir=folder, prefix="unpack-"))
        self.limit = limit
        self.q: Queue[bytes | None] = Queue(self.DEPTH)
        self.buf = bytearray()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="witness-unpack", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            _unpack_stream(_QueueReader(self.q), self.staging, self.limit)
        except BaseException as e:  # noqa: BLE001 - handed to the receiving side
            self.error = e
        while self.q.get() is not None:  # the rest of the upload (a tar's padding; or after an error)
            pass

    async def _put(self, item: bytes | None) -> None:
        try:
            self.q.put_nowait(item)
        except Full:
            await asyncio.to_thread(self.q.put, item)

    async def feed(self, data: bytes) -> None:
        """The next piece of the upload; raises the unpacking's error as soon as there is one."""
        if self.error is not None:
            raise self.error
        self.buf += data
        if len(self.buf) >= self.FEED:
            piece, self.buf = bytes(self.buf), bytearray()
            await self._put(piece)

    async def finish(self) -> Path:
        """Wait for the unpacking to end; the staging folder, or its error."""
        if self.buf:
            await self._put(bytes(self.buf))
            self.buf = bytearray()
        await self._put(None)
        await asyncio.to_thread(self.thread.join)
        if self.error is not None:
            raise self.error
        return self.staging

    def abort(self) -> None:
        """Stop the thread and remove what it unpacked."""
        if self.thread.is_alive():
            while True:  # unblock it: it drains the queue to the end mark
                try:
                    self.q.put(None, timeout=0.1)
                    break
                except Full:
                    if not self.thread.is_alive():
                        break
            self.thread.join(30)
        shutil.rmtree(self.staging, ignore_errors=True)


class _QueueReader(io.RawIOBase):
    """The bytes of a queue of pieces (``None`` ends them), as a file ``tarfile`` reads in stream mode."""

    def __init__(self, q: Queue[bytes | None]):
        self.q, self.rest, self.done = q, memoryview(b""), False

    def readable(self) -> bool:
        """Yes."""
        return True

    def readinto(self, b) -> int:  # noqa: ANN001 - a writable buffer
        """Fill ``b`` from the current piece, waiting for the next one where it is used up."""
        while not self.rest and not self.done:
            piece = self.q.get()
            if piece is None:
                self.done = True
                self.q.put(None)  # for the thread's drain loop after the archive ends
            else:
                self.rest = memoryview(piece)
        n = min(len(b), len(self.rest))
        b[:n] = self.rest[:n]
        self.rest = self.rest[n:]
        return n


class LocalStore(Store):
    """Objects as files under ``root`` (the embedded default): ``runs/<id>/…``, ``online/<id>/…``."""

    def __init__(self, root: str | os.PathLike):
        self._work(Path(root))
        (self.root / "runs").mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        rel = PurePosixPath(key)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"not a key: {key!r}")
        return self.root / rel

    def local_bundle_root(self, run_id: int) -> Path:
        """Beside the run's objects: ``runs/<id>/bundle``."""
        return self.root / "runs" / str(int(run_id))

    def put(self, key: str, path: Path) -> None:
        """Move the file into place (one rename)."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)

    def fetch(self, key: str, dest: Path) -> Path:
        """A hard link to the file (a copy where links do not reach)."""
        src = self.path(key)
        if not src.is_file():
            raise FileNotFoundError(f"the store holds no {key}")
        link_or_copy(src, dest)
        return dest

    def exists(self, key: str) -> bool:
        """Whether the file is there."""
        return self.path(key).is_file()

    def sha256(self, key: str) -> str:
        """Hashed from the file."""
        return file_sha256(self.path(key)).hex()

    def response(self, key: str, filename: str | None = None, media_type: str | None = None,
                 redirect: bool = False) -> Any:  # noqa: ANN401
        """The file, streamed by the web framework (a local store has no links to redirect to)."""
        from fastapi.responses import FileResponse

        return FileResponse(self.path(key), filename=filename, media_type=media_type)

    def keys(self, prefix: str) -> Iterator[tuple[str, float]]:
        """Files under the prefix's folder (the unpacked bundles under ``runs/<id>/bundle`` are not objects)."""
        folder = prefix.rpartition("/")[0]  # the folder the prefix names, or ends inside
        base = self.path(folder) if folder else self.root
        if not base.is_dir():
            return
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if rel.startswith(prefix) and p.is_file() and not p.is_symlink() and "/bundle/" not in f"/{rel}" \
                    and not rel.startswith("incoming/"):
                yield rel, p.lstat().st_mtime

    def delete(self, key: str) -> None:
        """Remove the file."""
        self.path(key).unlink(missing_ok=True)

    def _sink(self) -> Sink:
        """A file in ``incoming/``, beside the objects: keeping it is one rename."""
        return FileSink(self.root / "incoming")

    def keep(self, upload: Upload, key: str) -> None:
        """Moved into place."""
        if upload.ref is None:
            raise ValueError("the upload was kept or dropped already")
        self.put(key, Path(upload.ref))
        upload.ref = None


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


def open_store(spec: str | os.PathLike, work: str | os.PathLike | None = None,
               presign_endpoint: str | None = None, cache_bytes: int | None = None) -> Store:
    """The store a ``--store`` names: a folder (``LocalStore``), or ``s3://bucket[/prefix]``
    (``S3Store``, endpoint and credentials from the environment, working folder ``work``, downloads
    presigned for ``presign_endpoint`` where it is given, at most ``cache_bytes`` of unpacked bundles
    kept in ``work``)."""
    text = str(spec)
    if text.startswith("s3://"):
        from .s3store import S3Store

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


def _mkstemp(folder: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(dir=folder, prefix="upload-", suffix=".tar")


def _member_path(name: str) -> PurePosixPath:
    """The checked relative path of an archive member."""
    if "\\" in name or "\x00" in name:
        raise MalformedInput(f"archive member {name!r} has a forbidden character")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("..", "") for part in p.parts) or not p.parts:
        raise MalformedInput(f"archive member {name!r} escapes the upload (absolute path or '..')")
    parts = [x for x in p.parts if x != "."]
    if not parts:
        raise MalformedInput(f"archive member {name!r} has no name")
    p = PurePosixPath(*parts)
    if parts[0] != "bundle" and p != PurePosixPath(EVALUATION):
        raise MalformedInput(f"archive member {name!r} is neither under bundle/ nor {EVALUATION}")
    return p


MAX_TAR_META = 1 << 16  # bytes of a pax or GNU long-name header: a long path and a few fields need far less
_META_TYPES = frozenset((tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                         tarfile.SOLARIS_XHDTYPE))


class _BoundedInfo(tarfile.TarInfo):
    """A tar header whose pax or GNU long-name records are bounded before ``tarfile`` reads them
    (it reads such a record whole, however large the header says it is), and counted against the
    archive's unpacked bytes."""

    def _proc_member(self, tarfile_: tarfile.TarFile):  # noqa: ANN202 - tarfile's own hook
        if self.type in _META_TYPES:
            if self.size > MAX_TAR_META:
                raise MalformedInput(f"the archive has a {self.size}-byte extended header; at most {MAX_TAR_META}")
            tarfile_.witness_meta = getattr(tarfile_, "witness_meta", 0) + self.size
        return super()._proc_member(tarfile_)


def _unpack(archive: Path, dest: Path, limit: int) -> None:
    try:
        tf = tarfile.open(archive, mode="r:*", tarinfo=_BoundedInfo)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise MalformedInput(f"the upload is not a tar archive: {e}") from None
    _members(tf, dest, limit)


def _unpack_stream(f: io.RawIOBase, dest: Path, limit: int) -> None:
    """As ``_unpack``, reading the archive once, front to back, as it arrives."""
    try:
        tf = tarfile.open(fileobj=io.BufferedReader(f, 1 << 20), mode="r|*", tarinfo=_BoundedInfo)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise MalformedInput(f"the upload is not a tar archive: {e}") from None
    _members(tf, dest, limit)


def _members(tf: tarfile.TarFile, dest: Path, limit: int) -> None:
    """Write an archive's members under ``dest``, checking each name and the sizes first."""
    total = 0
    with tf:
        try:
            for i, member in enumerate(tf):
                if i >= MAX_MEMBERS:
                    raise MalformedInput(f"the archive has more than {MAX_MEMBERS} members")
                rel = _member_path(member.name)
                target = dest / rel
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise MalformedInput(f"archive member {member.name!r} is a link or special file")
                total += member.size
                if total + getattr(tf, "witness_meta", 0) > limit:  # the extended headers count too
                    raise MalformedInput(f"the archive unpacks to more than the server's limit of {limit} bytes")
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                if src is None:
                    raise MalformedInput(f"archive member {member.name!r} has no data")
                with src, open(target, "xb") as out:  # "x": a repeated name is refused, not overwritten
                    shutil.copyfileobj(src, out, 1 << 20)
        except FileExistsError as e:
            raise MalformedInput(f"the archive names a file twice: {Path(e.filename).relative_to(dest)}") from None
        except (tarfile.TarError, EOFError, OSError) as e:
            raise MalformedInput(f"the archive is damaged: {e}") from None
    if not (dest / "bundle").is_dir():
        raise MalformedInput("the archive has no bundle/ folder")


def pack(bundle_dir: str | os.PathLike, out: str | os.PathLike, evaluation: str | os.PathLike | None = None,
         leave_out: frozenset[str] = frozenset()) -> Path:
    """Pack a bundle (and its evaluation certificate) the way the server expects it, less the
    files named in ``leave_out`` (paths relative to the bundle)."""
    out = Path(out)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name.removeprefix("bundle").lstrip("/")
        return None if rel in leave_out else _plain(info)

    with tarfile.open(out, "w") as tf:
        tf.add(str(bundle_dir), arcname="bundle", recursive=True, filter=keep)
        if evaluation is not None:
            tf.add(str(evaluation), arcname=EVALUATION, filter=_plain)
    return out


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Strip owners and times: the archive holds content only."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info
