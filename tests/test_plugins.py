"""Tasks from installed plugin packages (entry-point group ``witness.tasks``): discovered,
trained and verified; a verifier without exactly the run's plugin code refuses with exit 2 and
says what to install."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from plugin_site import installed

from witness.cli import main
from witness.errors import MalformedInput
from witness.task import registry

PLUGIN = '''"""A plugin task: the tiny MLP under another name, shipped by its own distribution."""

from witness.task.tiny import TinyTask


class PluginMLP(TinyTask):
    """The plugin's task."""

    name = "plugin-mlp"
'''


def _install(site: Path, version: str = "1.0") -> Path:
    """A distribution as pip leaves it on a path: the package and its .dist-info with the entry point."""
    pkg = site / "witness_plugin_demo"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    for old in site.glob("witness_plugin_demo-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"witness_plugin_demo-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: witness-plugin-demo\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[witness.tasks]\nplugin-mlp = witness_plugin_demo:PluginMLP\n")
    return pkg


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path where the plugin is installed."""
    path = tmp_path / "site"
    _install(path)
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("witness_plugin_demo", None)
    registry._built.cache_clear()


def _verify(bundle: Path, capsys) -> tuple[int, str]:
    code = main(["verify", "--allow-weak", str(bundle), "--challenges", "2", "--json"])
    return code, capsys.readouterr().err


def test_a_plugin_task_is_discovered_trained_and_verified(site, tmp_path, capsys):
    assert "plugin-mlp" in registry.task_names() and "tiny" in registry.task_names()
    assert main(["train", "--task"]) == 0  # lists what is installed
    listed = capsys.readouterr().out
    assert "plugin-mlp" in listed and "plugin witness-plugin-demo 1.0" in listed and "tinygpt" in listed
    out = tmp_path / "run"
    assert main(["train", "--task", "plugin-mlp", "--steps", "6", "--checkpoint-every", "3", "--quiet",
                 "--key", str(tmp_path / "k.pem"), "--out", str(out)]) == 0
    manifest = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    source = manifest["task_source"]
    assert source["distribution"] == "witness-plugin-demo" and source["version"] == "1.0"
    assert source["files_sha256"] == registry.package_files_sha256("witness_plugin_demo")
    assert _verify(out, capsys)[0] == 0
    # eval and verify-eval work with the plugin task too
    cert = tmp_path / "cert.json"
    assert main(["eval", str(out), "--out", str(cert), "--key", str(tmp_path / "k.pem"), "--quiet"]) == 0
    assert main(["verify-eval", str(cert), "--bundle", str(out), "--spot", "3", "--json", "--allow-weak"]) == 0
    capsys.readouterr()

    # a verifier without the plugin: exit 2, and the exact pip install
    sys.path.remove(str(site))
    sys.modules.pop("witness_plugin_demo", None)
    code, err = _verify(out, capsys)
    assert code == 2 and "pip install 'witness-plugin-demo==1.0'" in err, err
    sys.path.insert(0, str(site))

    # another version of it: exit 2
    _install(site, "1.1")
    code, err = _verify(out, capsys)
    assert code == 2 and "has witness-plugin-demo 1.1" in err and "==1.0" in err, err

    # the same version with other files (a patched install): exit 2
    pkg = _install(site, "1.0")
    assert _verify(out, capsys)[0] == 0
    (pkg / "__init__.py").write_text(PLUGIN + "\n# patched\n")
    code, err = _verify(out, capsys)
    assert code == 2 and "not the ones the run used" in err, err

    # installed, but its code does not import: its own error, not "not installed" (issue 52, loops item 2)
    (pkg / "__init__.py").write_text("import witness_no_such_dependency\n" + PLUGIN)
    sys.modules.pop("witness_plugin_demo", None)
    code, err = _verify(out, capsys)
    assert code == 2 and "ModuleNotFoundError" in err and "witness_no_such_dependency" in err, err
    assert "not installed" not in err


def test_the_manifest_cannot_move_a_task_between_builtin_and_plugin(site):
    with pytest.raises(MalformedInput, match="built into witness"):
        registry.check_task_source("tiny", {"distribution": "x", "version": "1", "files_sha256": "00" * 32})
    with pytest.raises(MalformedInput, match="pins no plugin code"):
        registry.check_task_source("plugin-mlp", None)
    with pytest.raises(MalformedInput, match="not a task of this witness release"):
        registry.check_task_source("nowhere", None)


def test_an_unregistered_task_class_is_not_recorded(site, tmp_path):
    from witness.commit.signing import generate_key
    from witness.record import Recorder
    from witness.task.tiny import TinyTask

    class Homemade(TinyTask):
        name = "plugin-mlp"  # the name of a registered task, but not its class

    with pytest.raises(ValueError, match="not the registered class"):
        Recorder.create(Homemade.from_config({"steps": 2}), tmp_path / "r", generate_key(), r=b"\x01" * 32)


def test_the_example_plugin_trains_verifies_and_rejects_a_tampered_copy(tmp_path, capsys):
    # examples/cnn_plugin, installed by the project's set-up (make setup): a BatchNorm CNN in 40 lines
    assert "example-cnn" in registry.task_names(), "the example plugin is not installed: run make setup"
    from witness.bundle.state import state_tensors
    from witness.verify import Evidence, Policy, Verifier
    from witness.verify.respond import respond

    out = tmp_path / "run"
    assert main(["train", "--task", "example-cnn", "--steps", "8", "--checkpoint-every", "4", "--quiet",
                 "--key", str(tmp_path / "k.pem"), "--out", str(out)]) == 0
    manifest = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert manifest["task_source"]["distribution"] == "witness-example-cnn"
    assert manifest["task_config"]["optimizer"] == "AdamW"  # the optimizer is part of the recipe
    assert Verifier(policy=Policy(challenges=8, nonce=b"o")).verify(out).accepted  # offline, every step
    respond(out, tmp_path / "answer", nonce=b"i", challenges=8)
    assert Verifier(policy=Policy(challenges=8, nonce=b"i", mode="interactive")).verify(out, Evidence(response=tmp_path / "answer")).accepted

    # the probes leave BatchNorm's running statistics untouched
    task = registry.build_task("example-cnn", manifest["task_config"])
    model = task.build_model(b"\x05" * 32)
    model.train()
    before = {k: v.clone() for k, v in state_tensors(model, None).items()}
    task.fingerprint(model)
    after = state_tensors(model, None)
    assert any("running_mean" in k for k in before) and all(torch.equal(before[k], after[k]) for k in before)
    assert model.training

    # a tampered copy: the last step's loss changed and the log re-signed is still refused at replay
    lines = (out / "log.jsonl").read_text().splitlines()
    rec = json.loads(lines[4])
    rec["loss"] = rec["loss"] * 0.5
    from helpers import resign

    from witness.commit.hashing import canonical_json
    from witness.commit.signing import load_key

    resign(out, load_key(tmp_path / "k.pem"), [ln.encode() for ln in lines[:4]] + [canonical_json(rec)]
           + [ln.encode() for ln in lines[5:]])
    capsys.readouterr()
    assert main(["verify", "--allow-weak", str(out), "--challenges", "8", "--nonce", "01", "--json"]) == 1


def test_a_safetensors_header_of_640_bytes_is_not_a_pickle():
    from witness.bundle.reader import looks_like_pickle

    assert looks_like_pickle(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00")  # pickle protocol 4
    assert not looks_like_pickle((0x280).to_bytes(8, "little") + b"{")  # a safetensors header 640 bytes long


def test_a_plugin_run_resumes_and_a_track_can_name_a_plugin_task(site, tmp_path, capsys):
    from witness.commit.signing import generate_key, save_key
    from witness.leaderboard.tracks import parse_track
    from witness.record import Commitments, Recorder

    key = generate_key()
    save_key(key, tmp_path / "k.pem")
    task = registry.build_task("plugin-mlp", {"steps": 12})
    rec = Recorder.create(task, tmp_path / "run", key, r=b"\x03" * 32, commit=Commitments(checkpoint_every=4))
    for t in range(6):  # killed after the checkpoint at step 4 and two more steps
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    del rec
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--key", str(tmp_path / "k.pem"), "--quiet"]) == 0
    assert "resuming" in capsys.readouterr().err
    assert _verify(tmp_path / "run", capsys)[0] == 0
    track = parse_track("mine=plugin-mlp:steps=12@accuracy+")
    assert track.task == "plugin-mlp" and track.resolve()["data_root"] == task.dataset().root.hex()


TIME_MAJOR = '''"""A plugin whose outputs on its probes come classes first: [classes, probes], not [probes, classes]."""

import torch

from witness.task.generic import GenericTask


class TimeMajor(GenericTask):
    """Trains as any classifier; its fingerprint's outputs are transposed."""

    name = "time-major"

    def make_model(self):
        return torch.nn.Linear(3, 5)

    def make_dataset(self):
        return [{"x": torch.full((3,), float(i)), "y": torch.tensor(i % 5)} for i in range(64)]

    def predict(self, model, batch):
        out = model(batch["x"])
        return out if torch.is_grad_enabled() else out.T  # the probes (no grad) on the wrong axis
'''


def test_a_plugin_whose_outputs_have_another_layout_is_refused_when_it_records(tmp_path, monkeypatch, capsys):
    """Its run would record and self-check, then every audit would refuse its fingerprints' size: it is
    refused at its first fingerprint instead, saying which layout it needs (issue 52, loops item 1)."""
    with installed(monkeypatch, tmp_path, "witness_time_major", "time-major", "TimeMajor", TIME_MAJOR):
        code = main(["train", "--task", "time-major", "--steps", "4", "--quiet", "--key", str(tmp_path / "k.pem"),
                     "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert code == 2 and "the shape [5, 8]" in err and "[probes, ..., width]" in err, err


NO_EVAL = '''"""A plugin with no evaluation split."""

import torch

from witness.task.generic import GenericTask


class NoEval(GenericTask):
    """A linear classifier; make_eval_dataset left as it is (no examples)."""

    name = "no-eval"

    def make_model(self):
        return torch.nn.Linear(3, 5)

    def make_dataset(self):
        return [{"x": torch.full((3,), float(i)), "y": torch.tensor(i % 5)} for i in range(64)]
'''


def test_evaluating_a_task_without_an_evaluation_split_is_refused(tmp_path, monkeypatch, capsys):
    """``witness eval`` of a task whose evaluation split is empty: a certificate of 0 examples would certify
    nothing, so none is made (issue 52, loops item 5)."""
    with installed(monkeypatch, tmp_path, "witness_no_eval", "no-eval", "NoEval", NO_EVAL):
        key, out = tmp_path / "k.pem", tmp_path / "run"
        assert main(["train", "--task", "no-eval", "--steps", "4", "--quiet", "--key", str(key), "--out", str(out)]) == 0
        capsys.readouterr()
        assert main(["eval", str(out), "--out", str(tmp_path / "cert.json"), "--key", str(key), "--quiet"]) == 2
        assert "nothing to certify" in capsys.readouterr().err and not (tmp_path / "cert.json").exists()
