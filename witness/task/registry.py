"""The tasks a verifier will build: the built-in ones, and those of installed plugin packages.

A verifier never runs code that comes inside a bundle. A plugin is a distribution the verifier
installed itself, which names its tasks in the entry-point group ``witness.tasks``
(``name = "package.module:TaskClass"``). The manifest of a plugin task's run commits the
distribution's name, its version and a hash of the installed files of the task's package, so
that a verifier replays with exactly the code the trainer ran, or refuses (unusable input,
exit 2) and says what to ``pip install``. Built-in tasks are pinned by the witness release.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import Distribution, EntryPoint, entry_points, packages_distributions
from pathlib import Path

from ..commit.hashing import canonical_json
from ..errors import MalformedInput
from .base import Task
from .tiny import TinyTask
from .tinycnn import TinyCNNTask
from .tinygpt import TinyGPTTask

ENTRY_POINT_GROUP = "witness.tasks"
BUILTIN: dict[str, type[Task]] = {t.name: t for t in (TinyTask, TinyCNNTask, TinyGPTTask)}
TASKS = BUILTIN  # the built-in tasks (kept under its old name)
# Built-in tasks whose module needs an optional dependency: imported only when asked for.
OPTIONAL: dict[str, str] = {"hf-gpt2": "witness.integrations.hf:HFGPT2Task"}
SOURCE_FIELDS = ("distribution", "version", "files_sha256")


@dataclass(frozen=True)
class TaskSource:
    """Where a plugin task's code comes from: a distribution, its version, its files' hash."""

    distribution: str
    version: str
    files_sha256: str

    def to_json(self) -> dict:
        """The manifest's ``task_source``."""
        return {"distribution": self.distribution, "version": self.version, "files_sha256": self.files_sha256}

    def pip(self) -> str:
        """What to install to get this exact code."""
        return f"pip install '{self.distribution}=={self.version}'"


def _plugins() -> dict[str, list[EntryPoint]]:
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, []).append(ep)
    return found


def task_names() -> list[str]:
    """Names of the tasks this machine can build: built-in and installed plugins."""
    return sorted(set(BUILTIN) | set(OPTIONAL) | set(_plugins()))


def _entry_point(name: str) -> EntryPoint:
    eps = _plugins().get(name, [])
    if not eps:
        raise ValueError(f"unknown task {name!r}; tasks here: {', '.join(task_names())}")
    dists = {ep.dist.name if ep.dist else "?" for ep in eps}
    if len(eps) > 1:
        raise ValueError(f"task {name!r} is offered by more than one installed plugin ({', '.join(sorted(dists))})")
    return eps[0]


def package_files_sha256(module: str, also: tuple[str, ...] = ()) -> str:
    """SHA-256 over the files of ``module``'s top-level package, by relative path and content
    (compiled caches left out): the code a verifier would run, whether installed or editable.
    ``also``: the distribution's other top-level modules and packages (a plugin that lives next to
    the loop's own ``model.py`` and imports it), each file then named under its top-level name."""
    tops = [module.split(".")[0], *sorted(set(also) - {module.split(".")[0]})]
    entries = []
    for name in tops:
        top = importlib.import_module(name)
        roots = [Path(p) for p in getattr(top, "__path__", [])] or [Path(top.__file__)]
        for root in roots:
            if root.is_dir():
                linked = [p for p in root.rglob("*") if p.is_symlink() and p.is_dir()]
                if linked:  # imported through, but not walked: code in it would go unpinned
                    raise ValueError(f"the plugin package {name} holds a linked folder ({linked[0]}): its code "
                                     "would not be pinned; link files, not folders")
            paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
            for p in paths:
                if "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo"):
                    continue
                rel = p.name if root.is_file() else p.relative_to(root).as_posix()
                # one top-level name hashes as it always did (runs recorded before stay pinned)
                entries.append([rel if len(tops) == 1 else f"{name}/{rel}", hashlib.sha256(p.read_bytes()).hexdigest()])
    return hashlib.sha256(canonical_json(sorted(entries))).hexdigest()


def top_level_names(dist: Distribution) -> tuple[str, ...]:
    """The top-level modules and packages a distribution installs: its ``top_level.txt`` (setuptools),
    else the top-level modules its ``RECORD`` lists (hatchling, flit, poetry and pdm write no
    ``top_level.txt``); a name another installed distribution also claims (a ``top_level.txt`` that
    names ``torch``) is left out, so that the pin is this distribution's code only."""
    text = dist.read_text("top_level.txt")
    if text is not None:
        names = {line.strip() for line in text.splitlines()}
    else:
        names = set()
        for f in dist.files or []:
            first = f.parts[0] if f.parts else ""
            if first.endswith((".dist-info", ".egg-info", ".data")) or first.startswith("__editable__"):
                continue
            if len(f.parts) > 1 and first != "__pycache__":
                names.add(first)
            elif f.suffix in (".py", ".so", ".pyd"):
                names.add(first.split(".")[0])
    names = {n for n in names if n.isidentifier()}
    owners = packages_distributions()
    return tuple(sorted(n for n in names if not set(owners.get(n, [])) - {dist.metadata["Name"]}))


def task_source(name: str) -> TaskSource | None:
    """None for a built-in task; else the installed plugin that provides ``name``."""
    if name in BUILTIN or name in OPTIONAL:
        return None
    ep = _entry_point(name)
    dist = ep.dist
    if dist is None:
        raise ValueError(f"task {name!r} comes from no installed distribution")
    return TaskSource(dist.name, dist.version, _plugin_code(name, ep, lambda: package_files_sha256(ep.module, top_level_names(dist))))


def _plugin_code(name: str, ep: EntryPoint, load):  # noqa: ANN001, ANN202 - a thunk and what it returns
    """``load()``, with a plugin whose code fails to import reported as a ``ValueError`` that names it
    (its own error, not a traceback out of witness)."""
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - whatever the plugin's module raised while importing
        where = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
        raise ValueError(f"the plugin task {name!r} ({where}, {ep.value}) cannot be loaded: "
                         f"{type(e).__name__}: {e}") from None


def check_task_source(name: str, committed: dict | None) -> None:
    """Raise ``MalformedInput`` unless this machine builds ``name`` from exactly the code the run
    committed: the message says what to install."""
    if committed is None:
        if name in BUILTIN or name in OPTIONAL:
            return
        if name in _plugins():
            raise MalformedInput(f"task {name!r} is a plugin here, but the manifest pins no plugin code for it")
        raise MalformedInput(f"task {name!r} is not a task of this witness release ({', '.join(task_names())})")
    want = TaskSource(**{k: committed[k] for k in SOURCE_FIELDS})
    if name in BUILTIN or name in OPTIONAL:
        raise MalformedInput(f"task {name!r} is built into witness, but the manifest names plugin {want.distribution}")
    try:
        have = task_source(name)
    except ValueError as e:
        if name in _plugins():  # installed, and its code does not import: its own error says why
            raise MalformedInput(f"{e} (the run's task comes from {want.distribution} {want.version})") from None
        raise MalformedInput(f"the run's task {name!r} comes from the plugin {want.distribution} {want.version}, "
                             f"which is not installed here: {want.pip()}") from None
    assert have is not None
    if have.distribution != want.distribution or have.version != want.version:
        raise MalformedInput(f"the run's task {name!r} comes from {want.distribution} {want.version}; this machine "
                             f"has {have.distribution} {have.version}: {want.pip()}")
    if have.files_sha256 != want.files_sha256:
        raise MalformedInput(f"the installed files of {want.distribution} {want.version} are not the ones the run "
                             f"used (hash {have.files_sha256[:16]}… ≠ {want.files_sha256[:16]}…): reinstall the "
                             f"published release ({want.pip()} --force-reinstall)")


def task_class(name: str) -> type[Task]:
    """The class of a built-in or plugin task."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name in OPTIONAL:
        module, _, attr = OPTIONAL[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    ep = _entry_point(name)
    cls = _plugin_code(name, ep, ep.load)
    if not (isinstance(cls, type) and issubclass(cls, Task)) or getattr(cls, "name", None) != name:
        raise ValueError(f"the entry point {name!r} of group {ENTRY_POINT_GROUP} is not a Task named {name!r}")
    return cls


def build_task(name: str, config: dict | None = None) -> Task:
    """Build a task from its name and (partial) config."""
    if name not in BUILTIN and name not in OPTIONAL and name not in _plugins():
        raise ValueError(f"unknown task {name!r}; tasks here: {', '.join(task_names())}")
    return _built(name, canonical_json(config or {}))


@lru_cache(maxsize=8)
def _built(name: str, config: bytes) -> Task:
    # A task is immutable (a frozen recipe); building it again would hash its whole dataset again,
    # which repeated audits of one run (a leaderboard worker, the statistical tests) would pay
    # every time.
    return task_class(name).from_config(json.loads(config))

