"""nanoGPT's real train.py (examples/nanogpt, MIT, unchanged but for the lines marked ``# witness``)
witnessed as it is written: its own model, optimizer, get_batch (prefetching included), dropout and
gradient accumulation; verified offline, by the cheap audit with no data, and online."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import with_beacon

from witness.cli import main
from witness.task import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanogpt"
UPSTREAM = Path(__file__).resolve().parent / "data" / "nanogpt" / "train.py"  # karpathy/nanoGPT 3adf61e, as published
SETTINGS = ["--device=cpu", "--compile=False", "--dtype=float32", "--dataset=stdlib_char", "--n_layer=2", "--n_head=2",
            "--n_embd=64", "--block_size=64", "--batch_size=4", "--gradient_accumulation_steps=2", "--max_iters=7",
            "--dropout=0.2", "--eval_interval=4", "--eval_iters=2", "--log_interval=2", "--warmup_iters=2",
            "--lr_decay_iters=7", "--learning_rate=1e-3", "--min_lr=1e-4"]


def changed_lines(before: str, after: str) -> list[str]:
    """The lines a diff adds or removes."""
    return [d for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[:2] in ("+ ", "- ")]


CPU_RANKS = "# (CPU ranks, gloo)"  # nanoGPT's DDP branch names cuda:{rank}; these lines keep it on a GPU


def test_train_py_takes_at_most_10_changed_lines_and_the_plugin_at_most_40():
    changed = changed_lines(UPSTREAM.read_text(), (EXAMPLE / "train.py").read_text())
    witness = [line for line in changed if CPU_RANKS not in line and line.startswith("+ ")]
    assert 1 <= len(witness) <= 10, changed
    assert all("# witness" in line for line in witness)
    # nothing of nanoGPT's own goes but its DDP branch's three CUDA-only lines, which run CPU ranks (gloo) as
    # well and do what they did on a GPU
    ported = [line for line in changed if line not in witness]
    assert sorted(line[:2] for line in ported) == ["+ "] * 3 + ["- "] * 3, ported
    assert all(CPU_RANKS in line and "cuda" in line for line in ported if line.startswith("+ "))
    assert all("cuda" in line or "ddp_local_rank" in line for line in ported if line.startswith("- "))
    assert len((EXAMPLE / "witness_nanogpt" / "__init__.py").read_text().splitlines()) <= 40
    assert (EXAMPLE / "model.py").read_text().startswith('"""\nFull definition of a GPT Language Model')


def run_train(work: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *SETTINGS, *extra], cwd=work, capture_output=True, text=True,
                          timeout=600)


def prepared(tmp_path_factory, name: str) -> Path:
    """nanoGPT's folder as a user has it, its data prepared."""
    work = tmp_path_factory.mktemp(name) / "nanoGPT"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    p = subprocess.run([sys.executable, "prepare_stdlib.py", "--bytes", "60000"], cwd=work, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return work


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """nanoGPT's folder as a user has it: the data prepared, then train.py run as nanoGPT runs it."""
    work = prepared(tmp_path_factory, "nanogpt")
    p = run_train(work, "--out_dir=out")
    assert p.returncode == 0, p.stderr
    assert "iter 6" in p.stdout and "saving checkpoint to out" in p.stdout  # nanoGPT's own loop, evals and all
    assert "bit for bit" in p.stderr  # the self-check replayed its steps
    return work


def test_the_run_replays_every_step_offline_with_the_data_found_by_content(work, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(work)
    assert main(["verify", "out/witness", "--mode", "offline"]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED: nanogpt run of 8 steps" in out and "8 step(s) replayed = 100.00%" in out  # max_iters + 1
    moved = tmp_path / "elsewhere"
    shutil.copytree(work / "data" / "stdlib_char", moved / "renamed")
    (moved / "renamed" / "train.bin").rename(moved / "renamed" / "tokens.bin")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    registry._built.cache_clear()  # a verifier in a fresh process
    assert main(["verify", "--allow-weak", str(work / "out" / "witness"), "--mode", "offline", "--challenges", "3",
                 "--data", str(moved)]) == 0
    assert "tokens.bin (found by its content)" in capsys.readouterr().out  # a file this small is pinned by content


def test_the_cheap_audit_needs_no_data(work, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(work)
    assert main(["respond", "out/witness", "--nonce", "0a0b", "--challenges", "3", "--out", str(tmp_path / "r")]) == 0
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    registry._built.cache_clear()
    assert main(["verify", "--allow-weak", str(work / "out" / "witness"), "--mode", "interactive", "--nonce", "0a0b",
                 "--challenges", "3", "--response", str(tmp_path / "r")]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_online_mode_is_one_setting_of_train_py(work, tmp_path, capsys):
    key = with_beacon(tmp_path, lambda url: _train_online(work, url))
    assert main(["verify", "--allow-weak", str(work / "online" / "witness"), "--mode", "online", "--beacon-key", key]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def _train_online(work: Path, url: str) -> None:
    p = run_train(work, "--out_dir=online", f"--beacon={url}")
    assert p.returncode == 0, p.stderr


def test_a_weight_changed_in_the_bundle_is_rejected(work, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "run"
    shutil.copytree(work / "out" / "witness", copy)
    ckpt = sorted((copy / "checkpoints").iterdir())[-1]
    tensors = load_file(ckpt)
    name = next(k for k in tensors if k.startswith("model.") and tensors[k].is_floating_point())
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, ckpt)
    assert main(["verify", str(copy), "--mode", "offline", "--data", str(work)]) == 1
    assert "REJECTED: step 8: checkpoint" in capsys.readouterr().err
