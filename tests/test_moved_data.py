"""Data moved and renamed after training, found by its content by every command that reads it:
``verify``, ``eval``, ``verify-eval`` and ``data``. The plugin reads a training text, an evaluation
text and a tokenizer folder; after the run they lie elsewhere, under other names and suffixes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from witness.cli import main
from witness.task import registry

PLUGIN = '''
"""Lines of a text, labelled by their parity, read with a tokenizer folder of its own."""
import json
from dataclasses import dataclass

import torch
from torch import nn
from witness.data.locate import data_file
from witness.task.generic import GenericConfig, GenericTask

WIDTH = 16


@dataclass(frozen=True)
class Config(GenericConfig):
    steps: int = 6
    batch_size: int = 4
    lr: float = 0.05


def encoded(text_name):
    vocab = json.loads((data_file("data/tokenizer") / "vocab.json").read_text())["chars"]
    lines = data_file(text_name).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        ids = [vocab.index(c) + 1 if c in vocab else 0 for c in line[:WIDTH]]
        out.append({"x": torch.tensor(ids + [0] * (WIDTH - len(ids))), "y": torch.tensor(i % 2)})
    return out


class Moved(GenericTask):
    name, Config = "moved-data", Config

    def make_model(self):
        return nn.Sequential(nn.Embedding(40, 4), nn.Flatten(), nn.Linear(4 * WIDTH, 2))

    def make_dataset(self):
        return encoded("data/train.txt")

    def make_eval_dataset(self):
        return encoded("data/eval.txt")
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "witness_moved_demo").mkdir()
    (site / "witness_moved_demo" / "__init__.py").write_text(PLUGIN)
    info = site / "witness_moved_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: witness-moved-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[witness.tasks]\nmoved-data = witness_moved_demo:Moved\n")
    (info / "top_level.txt").write_text("witness_moved_demo\n")
    sys.path.insert(0, str(site))
    registry._plugins.cache_clear() if hasattr(registry._plugins, "cache_clear") else None
    yield site
    sys.path.remove(str(site))
    sys.modules.pop("witness_moved_demo", None)
    registry._built.cache_clear()


@pytest.fixture(scope="module")
def trained(plugin, tmp_path_factory):
    """A run trained in ``work`` (data/train.txt, data/eval.txt, data/tokenizer/vocab.json), its
    evaluation certificate, then the data moved to ``elsewhere`` under other names."""
    import os

    root = tmp_path_factory.mktemp("moved")
    work = root / "work"
    (work / "data" / "tokenizer").mkdir(parents=True)
    (work / "data" / "tokenizer" / "vocab.json").write_text(json.dumps({"chars": "abcdefghijklmnopqrstuvwxyz "}))
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly vexed kings".split()
    (work / "data" / "train.txt").write_text("\n".join(f"{words[i % 16]} {words[(3 * i) % 16]}" for i in range(40)))
    (work / "data" / "eval.txt").write_text("\n".join(f"{words[(5 * i) % 16][:3]} z {words[i % 16][:3]}" for i in range(12)))
    before = Path.cwd()
    os.chdir(work)
    try:
        assert main(["train", "--task", "moved-data", "--out", "run", "--key", "k.pem", "--quiet",
                     "--no-self-check"]) == 0
        assert main(["eval", "run", "--key", "k.pem", "--out", "cert.json", "--quiet"]) == 0
    finally:
        os.chdir(before)
        registry._built.cache_clear()
    manifest = json.loads((work / "run" / "log.jsonl").read_text().splitlines()[0])
    elsewhere = root / "elsewhere" / "any"
    elsewhere.mkdir(parents=True)
    shutil.copy(work / "data" / "train.txt", elsewhere / "corpus.data")  # another name, another suffix
    shutil.copy(work / "data" / "eval.txt", elsewhere / "heldout")  # no suffix at all
    shutil.copytree(work / "data" / "tokenizer", elsewhere / "tok-v1")  # the tokenizer folder, renamed
    shutil.rmtree(work / "data")
    return work, root / "elsewhere", manifest


@pytest.fixture
def away(trained, tmp_path, monkeypatch):
    """Run from an empty folder, the data only under --data."""
    monkeypatch.chdir(tmp_path)
    registry._built.cache_clear()
    yield trained
    registry._built.cache_clear()


def test_the_manifest_pins_every_file_and_the_tokenizer_folder(trained):
    _, _, manifest = trained
    pins = manifest["data_files"]
    assert set(pins) == {"data/train.txt", "data/eval.txt", "data/tokenizer"}, pins
    assert pins["data/tokenizer"].get("folder") is True and "folder" not in pins["data/train.txt"]


def test_verify_finds_renamed_data_whatever_its_suffix(away, capsys):
    work, elsewhere, _ = away
    assert main(["verify", str(work / "run"), "--data", str(elsewhere), "--mode", "offline"]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED" in out and "corpus.data (found by its content)" in out and "tok-v1 (found by its content)" in out


def test_eval_and_verify_eval_find_renamed_data(away, tmp_path, capsys):
    work, elsewhere, _ = away
    assert main(["eval", str(work / "run"), "--key", str(work / "k.pem"), "--out", str(tmp_path / "c.json"),
                 "--quiet", "--data", str(elsewhere)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "c.json").read_text())["aggregates"] == \
        json.loads((work / "cert.json").read_text())["aggregates"]
    assert main(["verify-eval", str(work / "cert.json"), "--bundle", str(work / "run"), "--spot", "12", "--allow-weak",
                 "--data", str(elsewhere)]) == 0, capsys.readouterr().err


def test_data_queries_find_renamed_data(away, tmp_path, capsys):
    work, elsewhere, _ = away
    # an exclusion proof needs the committed dataset (its used-document tree rebuilt): found renamed
    assert main(["data", "exclude", str(work / "run"), "--text", "no such line", "--data", str(elsewhere),
                 "--key", str(work / "k.pem"), "--out", str(tmp_path / "proof.json")]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "proof.json").read_text())["kind"] == "exclusion"
    assert main(["data", "check", str(tmp_path / "proof.json"), "--bundle", str(work / "run")]) == 0


def test_a_changed_tokenizer_folder_is_not_the_runs(away, tmp_path, capsys):
    work, elsewhere, _ = away
    other = tmp_path / "other"
    shutil.copytree(elsewhere, other)
    (other / "any" / "tok-v1" / "vocab.json").write_text(json.dumps({"chars": "zyxwvutsrqponmlkjihgfedcba "}))
    assert main(["verify", str(work / "run"), "--data", str(other), "--mode", "offline"]) == 2
    assert "'data/tokenizer' (sha256" in capsys.readouterr().err
