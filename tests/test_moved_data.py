"""Data moved and renamed after training, found by its content by every command that reads it:
``verify``, ``eval`` and ``data``. The plugin reads a training text, an evaluation text and a tokenizer
folder; after the run the training text and the tokenizer lie elsewhere, under other names and
suffixes. The evaluation split is the verifier's own, found by its name only: a split found by a
run's pin or a certificate's root would be one the trainer chose."""

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
    (root / "elsewhere" / "data").mkdir()
    shutil.copy(work / "data" / "eval.txt", root / "elsewhere" / "data" / "eval.txt")  # the verifier's own, by name
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


def own_split(elsewhere: Path, tmp_path: Path) -> Path:
    """The verifier's data folders: the moved training files, and its own evaluation split with the
    tokenizer it reads, by their names (the split is never found by content)."""
    mine = tmp_path / "mine"
    shutil.copytree(elsewhere, mine)
    shutil.copytree(elsewhere / "any" / "tok-v1", mine / "data" / "tokenizer")
    return mine


def test_the_manifest_pins_the_training_files_and_the_tokenizer_folder(trained):
    _, _, manifest = trained
    pins = manifest["data_files"]
    assert set(pins) == {"data/train.txt", "data/tokenizer"}, pins  # not the evaluation split: the verifier's
    assert pins["data/tokenizer"].get("folder") is True and "folder" not in pins["data/train.txt"]


def test_verify_finds_renamed_data_whatever_its_suffix(away, capsys):
    work, elsewhere, _ = away
    assert main(["verify", str(work / "run"), "--data", str(elsewhere), "--mode", "offline"]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED" in out and "corpus.data (found by its content)" in out and "tok-v1 (found by its content)" in out


def test_eval_finds_renamed_training_data_and_verify_eval_the_split_by_its_name(away, tmp_path, capsys):
    work, elsewhere, _ = away
    assert main(["eval", str(work / "run"), "--key", str(work / "k.pem"), "--out", str(tmp_path / "c.json"),
                 "--quiet", "--data", str(elsewhere)]) == 2  # the split's tokenizer is not where its name points
    assert "'data/tokenizer' is in none of the data folders" in capsys.readouterr().err
    mine = own_split(elsewhere, tmp_path)
    assert main(["eval", str(work / "run"), "--key", str(work / "k.pem"), "--out", str(tmp_path / "c.json"),
                 "--quiet", "--data", str(mine)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "c.json").read_text())["aggregates"] == \
        json.loads((work / "cert.json").read_text())["aggregates"]
    assert main(["verify-eval", str(work / "cert.json"), "--bundle", str(work / "run"), "--spot", "12", "--allow-weak",
                 "--data", str(mine)]) == 0, capsys.readouterr().err


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


def test_an_extra_file_in_the_verifiers_tokenizer_folder_is_no_reason_to_fail(away, tmp_path, capsys):
    """The verifier's tokenizer folder holds one file more than the trainer's (a .gitattributes): no
    folder has the pinned digest, so the one the name points to is read, and the committed root decides."""
    work, elsewhere, _ = away
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    shutil.copytree(elsewhere / "any" / "tok-v1", mine / "data" / "tokenizer")
    (mine / "data" / "tokenizer" / ".gitattributes").write_text("*.json text\n")
    shutil.copy(elsewhere / "any" / "corpus.data", mine / "data" / "train.txt")
    assert main(["verify", str(work / "run"), "--data", str(mine), "--mode", "offline"]) == 0, capsys.readouterr()


def test_a_fifo_or_a_device_in_a_candidate_folder_does_not_hang_the_verifier(away, tmp_path, capsys):
    import os
    import subprocess

    work, elsewhere, _ = away
    trap = tmp_path / "trap" / "any"
    shutil.copytree(elsewhere / "any", trap)
    os.mkfifo(trap / "tok-v1" / "pipe")  # size 0: the folder's total is still the pin's
    (trap / "tok-v1" / "zero").symlink_to("/dev/zero")
    p = subprocess.run([sys.executable, "-m", "witness.cli", "verify", str(work / "run"), "--data", str(tmp_path / "trap"),
                        "--mode", "offline"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(sys.modules["witness_moved_demo"].__path__[0].rsplit("/", 1)[0]),
                                                                       os.environ.get("PYTHONPATH", "")])})
    assert p.returncode == 2 and "'data/tokenizer'" in p.stderr, p.stderr  # not the run's folder: named missing


@pytest.mark.parametrize("pinned", [False, True])
def test_a_certificate_over_a_split_the_trainer_planted_is_rejected(away, tmp_path, capsys, monkeypatch, pinned):
    """The trainer certifies its model on lines of its own, ships them beside the bundle (in the
    verifier's working folder) and, ``pinned``, pins them as ``data/eval.txt`` in its signed manifest.
    The verifier's own split is found by its name; the certificate does not match it and is rejected."""
    import os

    from witness.record import start

    work, elsewhere, _ = away
    easy = "\n".join(f"line {i}" for i in range(12))
    if pinned:  # the trainer's own code, writing the pin it likes into the manifest it signs
        real = start.side_files
        monkeypatch.setattr(start, "side_files", lambda names: real(names) | {"data/eval.txt": {
            "sha256": __import__("hashlib").sha256(easy.encode()).hexdigest(), "size": len(easy)}})
    trainer = tmp_path / "trainer"
    (trainer / "data").mkdir(parents=True)
    shutil.copytree(elsewhere / "any" / "tok-v1", trainer / "data" / "tokenizer")
    shutil.copy(elsewhere / "any" / "corpus.data", trainer / "data" / "train.txt")
    (trainer / "data" / "eval.txt").write_text(easy)
    os.chdir(trainer)
    assert main(["train", "--task", "moved-data", "--out", "run", "--key", "k.pem", "--quiet", "--no-self-check"]) == 0
    assert ("data/eval.txt" in json.loads((trainer / "run" / "log.jsonl").read_text().splitlines()[0])["data_files"]) \
        == pinned
    assert main(["eval", "run", "--key", "k.pem", "--out", "cert.json", "--quiet"]) == 0
    release = tmp_path / "release"
    shutil.copytree(trainer / "run", release / "run")
    shutil.copy(trainer / "cert.json", release / "cert.json")
    (release / "docs").mkdir()
    (release / "docs" / "CHANGES.txt").write_text(easy)  # the planted split, on the verifier's search path
    os.chdir(release)
    registry._built.cache_clear()
    capsys.readouterr()
    assert main(["verify-eval", "cert.json", "--bundle", "run", "--spot", "12", "--allow-weak",
                 "--data", str(own_split(elsewhere, tmp_path))]) == 1
    assert "not the task's evaluation split here" in capsys.readouterr().err
