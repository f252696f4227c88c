"""A method as a wheel: read strictly, hashed, and unpacked, without running any of its code.

A wheel is a zip archive (PEP 427). Everything here reads it as untrusted input: its size, its
number of files and each file's unpacked size are bounded, no name may leave the folder it is
unpacked into (absolute paths, ``..``, links), and it must carry exactly one ``.dist-info`` with its
name, version and the tasks it offers (entry-point group ``witness.tasks``). The pin a run's manifest
commits (``task_source.files_sha256``, ``witness.task.registry.package_files_sha256``) is computed here
from the archive's own bytes, so a verifier knows which code it was handed before it runs any of it.
"""

from __future__ import annotations

import configparser
import hashlib
import io
import stat
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from ..commit.hashing import canonical_json
from ..errors import MalformedInput

ENTRY_POINT_GROUP = "witness.tasks"
# A method is code: the cap also bounds what it could carry besides code (weights trained elsewhere)
MAX_WHEEL_BYTES = 4 << 20
MAX_UNPACKED_BYTES = 16 << 20
MAX_FILES = 1000


@dataclass(frozen=True)
class MethodWheel:
    """A wheel's identity and what it offers: its file's SHA-256, its distribution and version, the
    tasks it names (task name -> ``module:Class``) and the hash of its code as a manifest pins it."""

    sha256: str
    distribution: str
    version: str
    tasks: dict[str, str]
    files_sha256: str
    files: dict[str, bytes]  # what is unpacked: relative path -> bytes
    tops: tuple[str, ...] = ()  # its top-level packages and modules

    def source(self) -> dict:
        """The manifest's ``task_source`` that a run of this method commits."""
        return {"distribution": self.distribution, "version": self.version, "files_sha256": self.files_sha256}

    def install(self, site: Path) -> Path:
        """Unpack into ``site`` (made; a folder for ``sys.path``): the archive's checked files only."""
        site.mkdir(parents=True, exist_ok=True)
        for rel, data in self.files.items():
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        return site


def _name(info: zipfile.ZipInfo) -> str | None:
    """The entry's checked relative path (None for a folder entry)."""
    name = info.filename
    if name.endswith("/"):
        return None
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise MalformedInput(f"the wheel holds a link ({name!r}): a method wheel holds files only")
    path = PurePosixPath(name)
    if "\\" in name or name.startswith("/") or not path.parts or any(p in ("", ".", "..") for p in path.parts) \
            or ":" in path.parts[0] or any(ord(c) < 32 for c in name):
        raise MalformedInput(f"the wheel holds a file named {name!r}, which would leave the folder it is unpacked into")
    return path.as_posix()


def read_wheel(data: bytes) -> MethodWheel:
    """Read a method's wheel strictly; ``MalformedInput`` says what is wrong with it."""
    if len(data) > MAX_WHEEL_BYTES:
        raise MalformedInput(f"the method's wheel is {len(data)} bytes, over the {MAX_WHEEL_BYTES} allowed")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise MalformedInput(f"the method is not a wheel (a zip archive): {e}") from None
    if len(infos) > MAX_FILES:
        raise MalformedInput(f"the wheel holds {len(infos)} entries, over the {MAX_FILES} allowed")
    files: dict[str, bytes] = {}
    total = 0
    for info in infos:
        name = _name(info)
        if name is None:
            continue
        if name in files:
            raise MalformedInput(f"the wheel holds {name!r} twice")
        total += info.file_size
        if total > MAX_UNPACKED_BYTES:
            raise MalformedInput(f"the wheel unpacks to over {MAX_UNPACKED_BYTES} bytes")
        try:
            with archive.open(info) as f:
                body = f.read(info.file_size + 1)
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError, EOFError) as e:
            raise MalformedInput(f"the wheel's {name!r} cannot be read: {e}") from None
        if len(body) != info.file_size:
            raise MalformedInput(f"the wheel's {name!r} is not the size its entry says")
        files[name] = body
    infos_dirs = sorted({n.split("/")[0] for n in files if n.split("/")[0].endswith(".dist-info")})
    if len(infos_dirs) != 1:
        raise MalformedInput(f"a wheel holds exactly one .dist-info folder; this one holds {len(infos_dirs)}")
    meta = infos_dirs[0]
    if any(n.split("/")[0].endswith(".data") for n in files):
        raise MalformedInput("the wheel installs files outside site-packages (a .data folder): a method wheel "
                             "holds its packages only")
    metadata = _text(files, f"{meta}/METADATA")
    headers = HeaderParser().parsestr(metadata)
    dist, version = (headers.get("Name") or "").strip(), (headers.get("Version") or "").strip()
    if not dist or not version:
        raise MalformedInput("the wheel's METADATA names no Name or no Version")
    tasks = _tasks(files.get(f"{meta}/entry_points.txt"))
    tops = _top_level(files, meta)
    _only_pinned_code(files, meta, tops)
    modules = {spec.split(":")[0].split(".")[0] for spec in tasks.values()}
    for module in sorted(modules):
        if module not in tops or not any(n.startswith(f"{module}/") or n.split(".")[0] == module for n in files):
            raise MalformedInput(f"the wheel's task module {module!r} is not a package or module the wheel holds")
    return MethodWheel(hashlib.sha256(data).hexdigest(), dist, version, tasks, _files_sha256(files, sorted(tops)),
                       files, tuple(sorted(tops)))


def _only_pinned_code(files: dict[str, bytes], meta: str, tops: set[str]) -> None:
    """Every file the wheel installs is one the pin covers: under its top-level packages and modules (or its
    .dist-info), never compiled bytecode (Python may run a .pyc without reading the source beside it, and
    the pin leaves caches out), and no name is both a file and a folder."""
    folders = {"/".join(n.split("/")[:i]) for n in files for i in range(1, n.count("/") + 1)}
    for top in tops:  # pkg.py beside pkg/ would hash like pkg/pkg.py, and never run (the package shadows it)
        if top in folders and any("/" not in n and n.split(".")[0] == top for n in files):
            raise MalformedInput(f"the wheel holds {top!r} both as a package and as a module")
    for name in files:
        parts = name.split("/")
        if name in folders:
            raise MalformedInput(f"the wheel holds {name!r} both as a file and as a folder")
        if "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
            raise MalformedInput(f"the wheel holds compiled bytecode ({name!r}): a method ships its sources, which "
                                 "its pin covers")
        top = parts[0] if len(parts) > 1 else parts[0].split(".")[0]
        if parts[0] != meta and top not in tops:
            raise MalformedInput(f"the wheel installs {name!r}, outside its packages ({', '.join(sorted(tops))}) and "
                                 "its .dist-info: the pin would not cover it")


def _text(files: dict[str, bytes], name: str) -> str:
    if name not in files:
        raise MalformedInput(f"the wheel has no {name}")
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedInput(f"the wheel's {name} is not UTF-8") from None


def _tasks(raw: bytes | None) -> dict[str, str]:
    """Its ``witness.tasks`` entry points: task name -> ``module:Class``."""
    if raw is None:
        raise MalformedInput("the wheel names no entry points: a method names its task in the group witness.tasks")
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign] - names keep their case
    try:
        parser.read_string(raw.decode("utf-8"))
    except (UnicodeDecodeError, configparser.Error) as e:
        raise MalformedInput(f"the wheel's entry_points.txt cannot be read: {e}") from None
    if not parser.has_section(ENTRY_POINT_GROUP) or not parser.items(ENTRY_POINT_GROUP):
        raise MalformedInput("the wheel names no task in the entry-point group witness.tasks")
    out = {}
    for name, value in parser.items(ENTRY_POINT_GROUP):
        module, sep, attr = value.strip().partition(":")
        if not sep or not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
            raise MalformedInput(f"the wheel's task {name!r} names {value.strip()!r}, not module:Class")
        out[name.strip()] = f"{module}:{attr}"
    return out


def _top_level(files: dict[str, bytes], meta: str) -> set[str]:
    """The top-level packages and modules it installs (its ``top_level.txt``, else its files)."""
    if f"{meta}/top_level.txt" in files:
        names = {line.strip() for line in _text(files, f"{meta}/top_level.txt").splitlines()}
    else:
        names = set()
        for n in files:
            first = n.split("/")[0]
            if first == meta:
                continue
            names.add(first if "/" in n else first.split(".")[0])
    return {n for n in names if n.isidentifier()}


def _files_sha256(files: dict[str, bytes], tops: list[str]) -> str:
    """What ``package_files_sha256`` gives for these files once installed: each top-level package's
    files (compiled caches left out) by path and content."""
    entries = []
    for top in tops:
        for name, body in files.items():
            parts = name.split("/")
            if "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
                continue
            if len(parts) > 1 and parts[0] == top:
                rel = "/".join(parts[1:])
            elif len(parts) == 1 and parts[0].split(".")[0] == top:
                rel = parts[0]
            else:
                continue
            entries.append([rel if len(tops) == 1 else f"{top}/{rel}", hashlib.sha256(body).hexdigest()])
    return hashlib.sha256(canonical_json(sorted(entries))).hexdigest()
