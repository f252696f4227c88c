"""The README's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

from witness.verify import verify_bundle

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_own_loop_snippet_runs_and_its_run_verifies(tmp_path, monkeypatch):
    text = README.read_text()
    section = text.split("## Witnessing your own loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 - our own README
    assert verify_bundle(tmp_path / "my-run", challenges=5).accepted
