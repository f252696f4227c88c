"""Uploads on the local disk: streamed to a file under a size limit, then unpacked strictly.

A submission is a tar archive (optionally gzip-compressed) holding ``bundle/…`` and
``evaluation.json``. Nothing in it is trusted: names are checked before a byte is written
(no absolute paths, no ``..``, no links or devices, only the expected top-level entries),
the unpacked size and file count are bounded, and files are written by this code, never by
``tarfile.extract``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath

from ..errors import MalformedInput

DEFAULT_MAX_UPLOAD = 512 * 1024 * 1024
MAX_MEMBERS = 100_000
EVALUATION = "evaluation.json"


class UploadTooLarge(MalformedInput):
    """The upload is over the server's limit."""


class Store:
    """Bundles and certificates of runs, one folder per run, under ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "incoming").mkdir(parents=True, exist_ok=True)
        (self.root / "runs").mkdir(parents=True, exist_ok=True)

    def run_dir(self, run_id: int) -> Path:
        """The folder of a run's accepted upload."""
        return self.root / "runs" / str(int(run_id))

    def bundle_dir(self, run_id: int) -> Path:
        """The unpacked bundle of a run."""
        return self.run_dir(run_id) / "bundle"

    def archive(self, run_id: int) -> Path:
        """The archive exactly as it was uploaded (served for download)."""
        return self.run_dir(run_id) / "submission.tar"

    def model_file(self, run_id: int) -> Path:
        """The run's final model as released (written by the server from the verified bundle)."""
        return self.run_dir(run_id) / "model.safetensors"

    def plots_dir(self, run_id: int) -> Path:
        """The plots drawn when the run was verified."""
        return self.run_dir(run_id) / "plots"

    def online_file(self, run_id: int, kind: str, step: int, sha256: str) -> Path:
        """An upload of a run with online challenges: the state before a selected step
        (``kind`` "states") or its batch's samples ("samples"), named by its SHA-256 too, so
        that a file is never replaced under the row that names it."""
        suffix = "safetensors" if kind == "states" else "json"
        return self.online_folder(run_id, kind) / f"{int(step):08d}.{sha256}.{suffix}"

    def online_folder(self, run_id: int, kind: str) -> Path:
        """The folder of a run's online uploads of one kind (``states`` or ``samples``)."""
        return self.root / "online" / str(int(run_id)) / kind

    def keep_online(self, run_id: int, kind: str, step: int, sha256: str, upload: Path) -> Path:
        """Move a received online upload to its place (before the row that names it is committed)."""
        if kind not in ("states", "samples") or len(sha256) != 64:
            raise ValueError(f"not an online upload: {kind} {sha256}")
        dest = self.online_file(run_id, kind, step, sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(upload, dest)
        return dest

    def leaves_file(self, data_root: str) -> Path:
        """Where a track's dataset leaves are kept once written (named by the data root they commit)."""
        return self.root / "leaves" / f"{data_root}.leaves"

    async def receive(self, chunks: AsyncIterator[bytes], limit: int) -> tuple[Path, str, int]:
        """Stream an upload to a temporary file; (path, sha256, bytes). Stops at ``limit`` bytes."""
        fd, name = _mkstemp(self.root / "incoming")
        digest, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise UploadTooLarge(f"the upload is over the server's limit of {limit} bytes")
                    digest.update(chunk)
                    f.write(chunk)
        except BaseException:
            os.unlink(name)
            raise
        return Path(name), digest.hexdigest(), size

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

    def accept(self, run_id: int, archive: Path, staging: Path) -> None:
        """Move a checked upload into the run's folder."""
        d = self.run_dir(run_id)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        os.replace(staging, d / "upload")
        os.replace(d / "upload" / "bundle", self.bundle_dir(run_id))
        if (d / "upload" / EVALUATION).exists():
            os.replace(d / "upload" / EVALUATION, d / EVALUATION)
        shutil.rmtree(d / "upload")
        os.replace(archive, self.archive(run_id))

    def discard(self, *paths: Path) -> None:
        """Remove rejected uploads."""
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()


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


def _unpack(archive: Path, dest: Path, limit: int) -> None:
    total = 0
    try:
        tf = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise MalformedInput(f"the upload is not a tar archive: {e}") from None
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
                if total > limit:
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
