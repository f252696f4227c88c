"""Where a task's data files are: found by name on a search path, never by an absolute path.

A recipe names its data relative (``"train.bin"``, ``"shakespeare/train.bin"``), so a run
recorded on one machine is verified on another wherever the data lies there. A task calls
``data_file(name)``; the name is looked up in the folders given with ``--data DIR`` (or
``data_dirs``), then those of the ``WITNESS_DATA`` variable (``os.pathsep``-separated), then the
working folder. The offline audit does not trust the name: it asks the task for its
dataset and, where that is missing or not the committed one, tries every file of the search
path that could be it (``candidates``) until one has the committed root.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..commit.hashing import canonical_json, file_sha256

SEARCH_ENV = "WITNESS_DATA"
MAX_CANDIDATES = 10_000  # files looked at per name: a search path is folders of data, not a disk

_dirs: ContextVar[tuple[Path, ...]] = ContextVar("witness_data_dirs", default=())
# name -> the file to use for it while an audit tries a candidate
_pinned: ContextVar[dict[str, Path] | None] = ContextVar("witness_data_pinned", default=None)
# names asked for since ``asked()`` began (what the offline audit must find)
# (every ``asked()`` block open, innermost last: a name counts for each)
_asked: ContextVar[tuple[list[str], ...]] = ContextVar("witness_data_asked", default=())
# within ``no_data()``: every name is missing, whatever lies on this disk
_no_data: ContextVar[bool] = ContextVar("witness_no_data", default=False)
# name -> (sha256, size): the file a name stands for is the one with that content (a run's data_files)
_by_content: ContextVar[dict[str, tuple[str, int, bool]] | None] = ContextVar("witness_by_content", default=None)
_found: ContextVar[dict[str, Path] | None] = ContextVar("witness_found", default=None)


@contextmanager
def data_dirs(dirs: list[str | os.PathLike]) -> Iterator[None]:
    """Within the block, search these folders first (``--data DIR``), in order."""
    found = []
    for d in dirs:
        p = Path(d).expanduser().resolve()
        if not p.is_dir():
            raise ValueError(f"--data {d}: no such folder")
        found.append(p)
    token = _dirs.set((*found, *_dirs.get()))
    try:
        yield
    finally:
        _dirs.reset(token)


def search_path() -> list[Path]:
    """The folders a data name is looked up in, in order."""
    env = [Path(p).expanduser() for p in os.environ.get(SEARCH_ENV, "").split(os.pathsep) if p]
    seen: list[Path] = []
    for p in [*_dirs.get(), *env, Path.cwd()]:
        if p not in seen:
            seen.append(p)
    return seen


def is_absolute(value: str) -> bool:
    """Whether a recipe string is an absolute path on any system (POSIX, Windows, or ``~``)."""
    return PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute() or value.startswith("~")


def check_name(name: str) -> None:
    """A data name is relative and stays inside the folder it is found in."""
    if not isinstance(name, str) or not name:
        raise ValueError("a data name is a non-empty relative path")
    if is_absolute(name):
        raise ValueError(f"the recipe names its data by the absolute path {name!r}: a verifier's data lies "
                         "elsewhere. Name it relative to a data folder (e.g. the file name) and pass that folder "
                         f"with --data DIR (or {SEARCH_ENV})")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise ValueError(f"the data name {name!r} leaves its folder ('..')")


def data_file(name: str) -> Path:
    """The file (or folder) a recipe's data name stands for here."""
    check_name(name)
    for names in _asked.get():
        if name not in names:
            names.append(name)
    if _no_data.get():
        raise FileNotFoundError(f"the data {name!r} is not read here (a decision that must not depend on the disk)")
    pinned = (_pinned.get() or {}).get(name)
    if pinned is not None:
        return pinned
    want = (_by_content.get() or {}).get(name)
    if want is not None:
        return _content(name, *want)
    found = on_search_path(name)
    if found is not None:
        return found
    where = ", ".join(str(d) for d in search_path())
    raise FileNotFoundError(f"the data {name!r} is in none of the data folders ({where}): pass the folder it lies "
                            f"in with --data DIR (or set {SEARCH_ENV})")


def on_search_path(name: str) -> Path | None:
    """Where the name itself points on the search path, the first folder that has it (None if none
    does); no pin and no content stands in for it."""
    for d in search_path():
        p = d / name
        if p.exists():
            return p
    return None


@contextmanager
def no_data() -> Iterator[None]:
    """Within the block, every data name is missing: for what must follow from a recipe alone (how a
    task's samples are decoded), never from which files a machine happens to hold."""
    token = _no_data.set(True)
    try:
        yield
    finally:
        _no_data.reset(token)


@contextmanager
def no_pins() -> Iterator[None]:
    """Within the block, every name is looked up by itself on the search path: no run's pinned content
    and no candidate stands in for it (the data a verifier brings of its own, an evaluation split)."""
    tokens = (_pinned.set(None), _by_content.set(None), _found.set(None))
    try:
        yield
    finally:
        for var, token in zip((_pinned, _by_content, _found), tokens, strict=True):
            var.reset(token)


@contextmanager
def by_content(files: dict[str, dict]) -> Iterator[dict[str, Path]]:
    """Within the block, a name of ``files`` (a manifest's ``data_files``: name -> sha256, size) stands
    for the file of the search path with that content, found when the task first asks for it (never
    for a name it does not read); the dict yielded fills with what was found where."""
    found: dict[str, Path] = {}
    t1 = _by_content.set({**(_by_content.get() or {}),
                          **{k: (v["sha256"], v["size"], bool(v.get("folder"))) for k, v in files.items()}})
    t2 = _found.set(found)
    try:
        yield found
    finally:
        _found.reset(t2)
        _by_content.reset(t1)


def _content(name: str, sha256: str, size: int, folder: bool) -> Path:
    found = _found.get()
    if found is not None and name in found:
        return found[name]
    path = find_by_content(name, sha256, size, folder)
    if path is None and folder:
        # a folder here with a file the run's had not (a README, a .gitattributes): the one the name
        # points to is read, and the data it builds is checked against the committed root as ever
        named = on_search_path(name)
        path = named if named is not None and named.is_dir() else None
        if path is not None:
            return path
    if path is None:
        where = ", ".join(str(d) for d in search_path())
        what = "folder" if folder else "file"
        raise FileNotFoundError(f"the run's data {what} {name!r} (sha256 {sha256[:16]}…, {size} bytes) is in none of "
                                f"the data folders ({where}): pass the folder it lies in with --data DIR (or set "
                                f"{SEARCH_ENV})")
    if found is not None:
        found[name] = path
    return path


@contextmanager
def pinned(files: dict[str, Path]) -> Iterator[None]:
    """Within the block, ``data_file(name)`` gives ``files[name]`` for the names given."""
    token = _pinned.set({**(_pinned.get() or {}), **files})
    try:
        yield
    finally:
        _pinned.reset(token)


@contextmanager
def asked() -> Iterator[list[str]]:
    """Collect the data names the block asks for."""
    names: list[str] = []
    token = _asked.set((*_asked.get(), names))
    try:
        yield names
    finally:
        _asked.reset(token)


def candidates(name: str, any_suffix: bool = False) -> Iterator[Path]:
    """Every entry of the search path that could hold the data ``name`` names: files with its suffix
    (for a name without one, folders and files without one too), the one at the name itself first;
    with ``any_suffix`` (a file found by its content, which a rename cannot hide), then every other
    file and folder."""
    check_name(name)
    suffix = PurePosixPath(name.rstrip("/")).suffix
    seen: set[Path] = set()
    looked = 0
    for d in search_path():
        first = _resolved(d / name)
        if first is not None and first not in seen:
            seen.add(first)
            yield d / name
    for same_suffix in (True, False) if any_suffix else (True,):
        for d in search_path():
            if not d.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(d):
                dirnames.sort()
                entries = sorted(filenames) + (dirnames if not suffix or not same_suffix else [])
                for e in entries:
                    looked += 1
                    if looked > MAX_CANDIDATES:
                        return
                    p = Path(dirpath) / e
                    real = _resolved(p) if (p.suffix == suffix) == same_suffix else None
                    if real is not None and real not in seen:
                        seen.add(real)
                        yield p


def _resolved(p: Path) -> Path | None:
    """Where an existing entry really is (None for one that is missing, unreadable or a link loop)."""
    try:
        return p.resolve() if p.exists() else None
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return None


SIDE_FILE_MAX = 64 << 20  # a file (or folder) a task reads up to this size is pinned by its hash in the manifest
SIDE_FILES_MAX = 64  # names a manifest pins so
SIDE_FOLDER_FILES = 1024  # files a pinned folder (a tokenizer's) may hold


def side_files(names: list[str]) -> dict[str, dict]:
    """What a run's manifest pins of the data files its task read (``asked``): each file up to
    ``SIDE_FILE_MAX`` by its SHA-256 and size, and each folder (a tokenizer's) by the hash of its
    files' names and contents, so a verifier finds it by content wherever it lies, under any name
    (a larger file, a corpus, is found by the dataset's committed root instead)."""
    out: dict[str, dict] = {}
    for name in names[:SIDE_FILES_MAX]:
        try:
            p = data_file(name)
        except FileNotFoundError:
            continue
        if p.is_file() and p.stat().st_size <= SIDE_FILE_MAX:
            out[name] = {"sha256": file_sha256(p).hex(), "size": p.stat().st_size}
        elif p.is_dir():
            digest = folder_digest(p)
            if digest is not None:
                out[name] = {"sha256": digest[0], "size": digest[1], "folder": True}
    return out


def folder_digest(folder: Path, size: int | None = None) -> tuple[str, int] | None:
    """SHA-256 over a folder's entries (each folder's path, each file's path, size and SHA-256, in path
    order) and its files' total size; None for a folder that holds anything but regular files and
    folders (a FIFO, a device, a linked folder), a name that is not UTF-8, more than
    ``SIDE_FOLDER_FILES`` files or ``SIDE_FILE_MAX`` bytes, or (``size`` given) files that are not that
    many bytes, found before any is hashed."""
    entries: list[tuple[str, Path | None, int, int]] = []  # (path inside, file, size, mtime)
    total = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        here = Path(dirpath)
        for d in dirnames:
            if (here / d).is_symlink():  # a linked folder is not walked: its files would go unhashed
                return None
            entries.append(((here / d).relative_to(folder).as_posix() + "/", None, 0, 0))
        for f in sorted(filenames):
            p = here / f
            try:
                st = p.stat()  # (a link to a regular file is read as that file)
            except OSError:
                return None
            if not stat.S_ISREG(st.st_mode):  # a FIFO would block, /dev/zero would never end
                return None
            total += st.st_size
            entries.append((p.relative_to(folder).as_posix(), p, st.st_size, st.st_mtime_ns))
            if len(entries) > SIDE_FOLDER_FILES or total > SIDE_FILE_MAX or size is not None and total > size:
                return None
    if size is not None and total != size:
        return None
    listing = [[rel, n, "" if p is None else _cached_sha256(str(p.resolve()), n, mtime)]
               for rel, p, n, mtime in entries]
    try:
        return hashlib.sha256(canonical_json(sorted(listing))).hexdigest(), total
    except (UnicodeError, ValueError):  # a name that is not text: not a folder a manifest can pin
        return None


def find_by_content(name: str, sha256: str, size: int, folder: bool = False) -> Path | None:
    """The file (or ``folder``) of the search path with this content: the one the name points to,
    else any candidate of that size and hash, whatever its name, suffix or folder."""
    for p in candidates(name, any_suffix=True):
        try:
            if folder:
                if p.is_dir() and folder_digest(p, size) == (sha256, size):
                    return p
                continue
            st = p.stat()
            if p.is_file() and st.st_size == size and _cached_sha256(str(p.resolve()), st.st_size, st.st_mtime_ns) == sha256:
                return p
        except (OSError, UnicodeError):
            continue
    return None


@functools.lru_cache(maxsize=4096)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    # one hash a file, however many names a run pins at that size (a file that changes is hashed again)
    return file_sha256(path).hex()
