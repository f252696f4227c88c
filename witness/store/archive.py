"""A submission's archive: a tar (optionally gzip-compressed) of ``bundle/…`` and
``evaluation.json``, unpacked strictly, in one pass as its bytes arrive. Nothing in it is trusted:
names are checked before a byte is written (no absolute paths, no ``..``, no links or devices,
only the expected top-level entries), the unpacked size, the file count and every extended header
are bounded, and files are written by this code, never by ``tarfile.extract``."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path, PurePosixPath
from queue import Full, Queue  # the standard library's (not the leaderboard's job queue)

from ..errors import MalformedInput
from .keys import EVALUATION

MAX_MEMBERS = 100_000


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


MAX_TAR_CHAIN = 4  # extended headers before one member (a global pax header, a long name, a pax header)
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
            # tarfile follows a chain of extended headers by recursion: a long one is refused first
            tarfile_.witness_chain = getattr(tarfile_, "witness_chain", 0) + 1
            if tarfile_.witness_chain > MAX_TAR_CHAIN:
                raise MalformedInput(f"the archive chains more than {MAX_TAR_CHAIN} extended headers before a member")
        else:
            tarfile_.witness_chain = 0
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
        except (tarfile.TarError, EOFError, OSError, RecursionError) as e:
            raise MalformedInput(f"the archive is damaged: {type(e).__name__}: {e}") from None
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
