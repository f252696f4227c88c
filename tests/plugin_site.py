"""A task plugin installed as pip leaves one on a folder of ``sys.path``, for the tests of plugins."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from witness.task import registry


@contextlib.contextmanager
def installed(monkeypatch, root: Path, package: str, task: str, cls: str, source: str) -> Iterator[Path]:  # noqa: ANN001
    """``package`` (its ``__init__.py`` holding ``source``) with its .dist-info naming ``task`` in
    ``witness.tasks`` (``package:cls``), on ``sys.path`` while the block runs; forgotten after it."""
    site = root / "site"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    info = site / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[witness.tasks]\n{task} = {package}:{cls}\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        yield site
    finally:
        sys.modules.pop(package, None)
        registry._built.cache_clear()
