"""Every code block marked ``python run`` in the docs runs as written, in a fresh folder and a
fresh process; where it wrote a run, that run verifies (``make docs-check`` runs this file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python run\n(.*?)^```$", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    """(where, code) of every runnable block of the docs."""
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in BLOCK.finditer(text):
            out.append((f"{page.name}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)))
    return out


def test_the_docs_have_a_runnable_snippet_for_each_framework():
    code = "\n".join(c for _, c in snippets())
    for needed in ("rec.batches(get_batch)", "attach(trainer, rec)", "committed_loader(rec, loader)",
                   "torch_schedule", "CorpusWindows", "byte_tokens"):
        assert needed in code


@pytest.mark.parametrize("where, code", snippets(), ids=[w for w, _ in snippets()])
def test_a_snippet_runs_as_written(where, code, tmp_path):
    (tmp_path / "snippet.py").write_text(code)
    p = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{where}:\n{p.stderr[-3000:]}"
    if (tmp_path / "run").is_dir():  # it witnessed a run: the stock verifier accepts it
        v = subprocess.run([sys.executable, "-m", "witness.cli", "verify", "run"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
        assert v.returncode == 0 and "ACCEPTED" in v.stdout, f"{where}:\n{v.stdout}\n{v.stderr[-3000:]}"
