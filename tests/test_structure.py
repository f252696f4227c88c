"""The shape of the package (DESIGN.md §4): small modules, no import circles, and the bottom layers
(``witness/commit``, ``witness/data``) free of torch. Read from the source with ``ast``: nothing is
imported, so the test costs well under a second."""

from __future__ import annotations

import ast
import functools
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "witness"
MAX_LINES = 450  # every module has fewer lines than this
LINES_EXEMPT = ("leaderboard/migrations/",)  # generated schema history, never edited
NO_TORCH = ("witness.commit", "witness.data")  # layers that never import torch, even indirectly
TORCH = ("torch", "safetensors.torch")  # modules whose import loads torch


def module_name(path: Path) -> str:
    """``witness/a/b.py`` -> ``witness.a.b``; ``witness/a/__init__.py`` -> ``witness.a``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package, by name."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.cache
def trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in modules().items()}


def _where(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """Where an import stands: its line, and the function or ``if TYPE_CHECKING`` block around it."""
    inside = []
    up = parents.get(node)
    while up is not None:
        if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) and not inside:
            inside.append(f"in {up.name}()")
        if isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test):
            inside.append("under TYPE_CHECKING")
        up = parents.get(up)
    return f"line {node.lineno}" + "".join(f", {w}" for w in inside)


def imports_of(name: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The witness modules ``name`` imports (each with where it first does), top level or inside a
    function, and its other imports (module, where).

    ``from P import x`` imports the module ``P.x`` where that is one, else ``P``; importing a package
    imports its ``__init__``."""
    known, tree = modules(), trees()[name]
    package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    inner: dict[str, str] = {}
    outer: list[tuple[str, str]] = []

    def add(target: str, node: ast.AST) -> None:
        if target in known:
            inner.setdefault(target, _where(node, parents))
        elif not target.startswith("witness.") and target != "witness":
            outer.append((target, _where(node, parents)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
            for sub in subs:
                add(sub, node)
            if len(subs) < len(node.names):  # names defined in the module (or package) itself
                add(source, node)
    inner.pop(name, None)
    return inner, outer


@functools.cache
def graph() -> dict[str, dict[str, str]]:
    """module -> {module it imports: where}."""
    return {name: imports_of(name)[0] for name in modules()}


def strongly_connected(g: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: any depth)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def shortest_path(g: dict[str, dict[str, str]], start: str, goal: str, allowed: set[str]) -> list[str]:
    """The shortest import path from ``start`` to ``goal`` through ``allowed`` modules."""
    came: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        if v == goal:
            path = [v]
            while came[path[-1]] is not None:
                path.append(came[path[-1]])  # type: ignore[arg-type]
            return path[::-1]
        for w in sorted(g[v]):
            if w in allowed and w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"no path from {start} to {goal}")


def circles(g: dict[str, dict[str, str]]) -> list[list[str]]:
    """For every import inside a circle, the shortest circle it is part of (each circle once, as a chain
    of modules starting and ending at its first module in sorted order)."""
    out: dict[tuple[str, ...], list[str]] = {}
    for comp in strongly_connected(g):
        members = set(comp)
        for u in comp:
            for v in sorted(g[u]):
                if v in members:
                    ring = [u, *shortest_path(g, v, u, members)[:-1]]
                    k = ring.index(min(ring))
                    ring = ring[k:] + ring[:k]
                    out.setdefault(tuple(ring), ring + [ring[0]])
    return sorted(out.values(), key=lambda c: (len(c), c))


def chain(g: dict[str, dict[str, str]], cycle: list[str]) -> str:
    short = [m.removeprefix("witness.") for m in cycle]
    steps = [short[0]] + [f"  -> {short[i + 1]}  ({cycle[i].replace('.', '/')}.py {g[cycle[i]][cycle[i + 1]]})"
                          for i in range(len(cycle) - 1)]
    return "\n    ".join(steps)


def test_modules_are_small():
    too_long = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(LINES_EXEMPT):
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines >= MAX_LINES:
            too_long.append(f"witness/{rel}: {lines} lines")
    assert not too_long, f"modules of {MAX_LINES} lines or more (split them by concern):\n  " + "\n  ".join(too_long)


def test_no_import_circles():
    g = graph()
    found = circles(g)
    assert not found, (f"{len(found)} import circle(s) among witness modules (imports inside functions count; "
                       "move the shared piece down so imports point one way):\n  "
                       + "\n  ".join(chain(g, c) for c in found))


def test_graph_reads_imports():
    """The graph sees relative, absolute and in-function imports, and ``from . import module``."""
    g = graph()
    assert "witness.task.base" in g["witness.task.tinygpt"]  # from .base import Task
    assert "witness.task.base" in g["witness.task"]  # the package's __init__
    assert "witness.commit.hashing" in g["witness.data.order"]  # from ..commit.hashing import
    assert "witness.verify.cheap" in g["witness.evals.weights"]  # inside check_tied()
    assert "in check_tied()" in g["witness.evals.weights"]["witness.verify.cheap"]
    assert "witness.leaderboard.queue" in g["witness.leaderboard.service"]  # from . import queue
    assert "witness.leaderboard" not in g["witness.leaderboard.service"]  # ... and not the package
    assert "witness" in g["witness.evals.serve"]  # from .. import __version__: the package's __init__
    toy = {"a": {"b": ""}, "b": {"c": ""}, "c": {"a": "", "d": ""}, "d": {}, "e": {"e2": ""}, "e2": {"e": ""}}
    assert circles(toy) == [["e", "e2", "e"], ["a", "b", "c", "a"]]


def test_bottom_layers_never_import_torch():
    """``witness/commit`` and ``witness/data`` import no torch, nor any witness module that does (the
    packages' ``__init__`` included, which Python runs first)."""
    g = graph()
    loads_torch = {}
    for name in modules():
        for target, where in imports_of(name)[1]:
            if target in TORCH or target.split(".")[0] == "torch":
                loads_torch.setdefault(name, f"imports {target} ({where})")
    bad = []
    for start in sorted(m for m in modules() if m.startswith(NO_TORCH)):
        came: dict[str, str | None] = {start: None}
        todo = deque([start])
        while todo:
            v = todo.popleft()
            nxt = set(g[v])
            parts = v.split(".")
            nxt |= {".".join(parts[:i]) for i in range(1, len(parts))}  # the packages above run first
            for w in sorted(nxt):
                if w in modules() and w not in came:
                    came[w] = v
                    todo.append(w)
        for v in sorted(came):
            if v in loads_torch:
                path = [v]
                while came[path[-1]] is not None:
                    path.append(came[path[-1]])  # type: ignore[arg-type]
                bad.append(f"{' -> '.join(path[::-1])}: {loads_torch[v]}")
                break
    assert not bad, "the torch-free layers (commit/, data/) reach torch:\n  " + "\n  ".join(bad)
