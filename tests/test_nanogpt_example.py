"""The worked example, examples/nanogpt_style: a nanoGPT-style loop witnessed by a few lines, its
model and data in a small plugin; it trains, verifies in both modes wherever its data lies (and
the cheap audit with no data at all), and a tampered copy is rejected."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from witness.cli import main
from witness.commit.signing import generate_key
from witness.record import Recorder, SelfChecking
from witness.task import build_task, registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanogpt_style"


def test_the_loop_is_witnessed_by_at_most_10_lines_and_the_plugin_is_at_most_40():
    code = (EXAMPLE / "train.py").read_text()
    body = code.split('"""', 2)[2]  # after the module docstring (which names the marker)
    marked = [line for line in body.splitlines() if re.search(r"#\s*witness\b", line)]
    assert 5 <= len(marked) <= 10
    assert len((EXAMPLE / "witness_example_nanogpt" / "__init__.py").read_text().splitlines()) <= 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example as a user runs it: prepare the data, train 8 steps with the loop's own code."""
    work = tmp_path_factory.mktemp("nanogpt")
    for name in ("prepare.py", "train.py"):
        shutil.copy(EXAMPLE / name, work / name)
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=work, capture_output=True, text=True,  # noqa: E731
                                       timeout=300)
    p = run("prepare.py", "--bytes", "120000")
    assert p.returncode == 0, p.stderr
    p = run("train.py", "--out_dir=run", "--max_iters=8", "--warmup_iters=2", "--log_interval=4")
    assert p.returncode == 0, p.stderr
    assert "iter 7" in p.stdout
    return work


def test_the_example_verifies_offline_with_its_data_moved_and_found_by_its_root(trained, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.chdir(trained)
    assert main(["verify", "--allow-weak", "run", "--mode", "offline", "--challenges", "3"]) == 0  # the data where the recipe names it
    capsys.readouterr()
    moved = tmp_path / "elsewhere" / "corpus"
    moved.parent.mkdir()
    shutil.copytree(trained / "data", moved)
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")  # the recipe's name, data/train.bin, means nothing here
    registry._built.cache_clear()  # a verifier in a fresh process (this one holds the dataset it found)
    assert main(["verify", "--allow-weak", str(trained / "run"), "--mode", "offline", "--challenges", "3"]) == 2
    err = capsys.readouterr().err
    assert "'data/train.bin'" in err and "pass the folder it lies in with --data DIR" in err
    assert main(["verify", "--allow-weak", str(trained / "run"), "--mode", "offline", "--challenges", "3", "--data",
                 str(tmp_path / "elsewhere")]) == 0
    out = capsys.readouterr().out
    # a file this small is pinned by its content in the manifest (a corpus, by the dataset's root)
    assert "ACCEPTED" in out and f"'data/train.bin' is {moved / 'train.bin'} (found by its content)" in out


def test_the_cheap_audit_needs_no_training_data(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(trained)
    assert main(["respond", "run", "--nonce", "0a0b", "--challenges", "2", "--out", str(tmp_path / "resp")]) == 0
    copy = tmp_path / "run"
    shutil.copytree(trained / "run", copy)
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")  # no data here, and none on the search path
    registry._built.cache_clear()  # nor any this process found before
    assert main(["verify", "--allow-weak", str(copy), "--mode", "interactive", "--nonce", "0a0b", "--challenges", "2",
                 "--response", str(tmp_path / "resp")]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_a_tampered_copy_of_the_example_is_rejected(trained, tmp_path, capsys, monkeypatch):
    copy = tmp_path / "run"
    shutil.copytree(trained / "run", copy)
    ckpt = copy / "checkpoints" / "00000008.safetensors"  # the final state: the run's claimed model
    tensors = load_file(ckpt)
    name = next(k for k in tensors if k.startswith("model.") and tensors[k].dim() == 2)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, ckpt)
    monkeypatch.chdir(trained)
    assert main(["verify", "--allow-weak", str(copy), "--mode", "offline", "--challenges", "2"]) == 1
    assert "REJECTED" in capsys.readouterr().err


def test_a_text_query_finds_the_windows_that_hold_its_tokens(trained, capsys, monkeypatch):
    monkeypatch.chdir(trained)
    assert main(["data", "find", "run", "--text", "import", "--json"]) in (0, 1)
    found = json.loads(capsys.readouterr().out)
    assert found["needle_bytes"] == 12 and found["samples_found"] > 0  # 6 byte tokens, 2 bytes each
    assert main(["data", "find", "run", "--text", "\x00never\x00there"]) == 1
    assert "0 document(s) of the run's dataset contain the 12 token(s)" in capsys.readouterr().out
    # a file to look for is bounded: a device is refused with a clear error, not read without end
    assert main(["data", "find", "run", "--file", "/dev/zero"]) == 2
    assert "--file /dev/zero: over 1048576 bytes" in capsys.readouterr().err
    assert main(["data", "exclude", "run", "--file", "/dev/zero", "--out", "p.json"]) == 2
    assert "larger than any document a proof names" in capsys.readouterr().err


def test_a_recipe_with_an_absolute_data_path_is_refused_at_record_time(trained, tmp_path):
    task = build_task("nanogpt-style", {"steps": 2, "batch_size": 4, "data": str(trained / "data" / "train.bin")})
    with pytest.raises(ValueError, match="absolute path .* --data DIR"):
        Recorder.create(task, tmp_path / "run", generate_key(), r=b"\1" * 32)
    assert not (tmp_path / "run").exists()


def test_probes_that_are_not_the_committed_samples_are_rejected(trained, tmp_path, capsys, monkeypatch):
    # The trainer signs what it likes: a run whose probes (carried in the bundle, so that the cheap
    # audit needs no data) are not the first samples of its committed dataset.
    monkeypatch.chdir(trained)
    task = build_task("nanogpt-style", {"steps": 2, "batch_size": 4, "data": "data/train.bin"})
    fake = [bytes(len(p)) for p in task.probe_bytes()]
    rec = Recorder.create(task.with_probes(fake), tmp_path / "run", generate_key(), r=b"\2" * 32,
                          self_check=SelfChecking(enabled=False))
    rec.train(progress=False)
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "1"]) == 1
    assert "probe 0 is not sample 0 of the committed dataset" in capsys.readouterr().err
    probes = tmp_path / "run" / "probes.json"  # and a probes file that is not the committed one at all
    probes.write_bytes(probes.read_bytes().replace(b'"0000', b'"0100', 1))
    assert main(["verify", "--allow-weak", str(tmp_path / "run"), "--challenges", "1"]) == 1
    assert "probes.json is not the probe set the manifest commits" in capsys.readouterr().err
