"""A store in a local folder: the embedded default."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from ..bundle.checkpoint import file_sha256
from .base import FileSink, Sink, Store, Upload, link_or_copy


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
