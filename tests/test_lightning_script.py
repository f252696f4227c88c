"""A Lightning script as people write it (examples/lightning_module) witnessed with its own
LightningModule, DataLoader and Trainer: a few lines, verified offline, by the cheap audit with no
data and online; a DataLoader over other data is refused."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import with_beacon

from witness.cli import main
from witness.task import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_module"


def test_the_script_takes_at_most_10_witness_lines_and_the_plugin_at_most_40():
    body = (EXAMPLE / "train_lit.py").read_text().split('"""', 2)[2]
    marked = [line for line in body.splitlines() if re.search(r"#\s*witness\b", line)]
    assert 1 <= len(marked) <= 10
    ast.parse("\n".join(line for line in body.splitlines() if not re.search(r"#\s*witness\b", line)))
    assert len((EXAMPLE / "witness_lit" / "__init__.py").read_text().splitlines()) <= 40


def run(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train_lit.py", *args], cwd=work, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("lit") / "project"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    p = run(work, "--steps", "8")
    assert p.returncode == 0, p.stderr
    assert "bit for bit" in p.stderr
    return work


def test_the_run_replays_every_step_and_the_cheap_audit_needs_no_data(work, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(work)
    assert main(["verify", "run"]) == 0
    assert "ACCEPTED: lit-points run of 8 steps" in capsys.readouterr().out
    assert main(["respond", "run", "--nonce", "0a0b", "--challenges", "3", "--out", str(tmp_path / "r")]) == 0
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    registry._built.cache_clear()
    assert main(["verify", "--allow-weak", str(work / "run"), "--mode", "interactive", "--nonce", "0a0b",
                 "--challenges", "3", "--response", str(tmp_path / "r")]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_a_loader_over_other_data_is_refused(work, tmp_path):
    import lightning as L
    import torch
    from witness_lit import train_lit

    from witness.integrations.lightning import committed_loader
    from witness.record import start_run

    model = train_lit.LitClassifier()
    loader = torch.utils.data.DataLoader(train_lit.points(seed=6), batch_size=8)  # other points
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    rec = start_run("lit-points", {"trainer": trainer, "loader": loader}, str(tmp_path / "run"), model=model,
                    key=str(tmp_path / "k.pem"))
    assert rec.task.config.batch_size == 16 and rec.task.config.grad_accum == 2 and rec.task.config.steps == 4
    with pytest.raises(ValueError, match="the loop's dataset .* is not the task's"):
        committed_loader(rec, loader)


def test_online_mode_is_one_environment_variable(work, tmp_path, capsys):
    def train(url):
        p = run(work, "--steps", "6", "--out", "online", env={"WITNESS_BEACON": url})
        assert p.returncode == 0, p.stderr

    key = with_beacon(tmp_path, train)
    assert main(["verify", "--allow-weak", str(work / "online"), "--mode", "online", "--beacon-key", key]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
