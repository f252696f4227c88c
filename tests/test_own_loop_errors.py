"""What a new user's first runs meet, said at once and in one line: a plugin that does not import,
a run that stopped before its first step, a nonce with an odd digit count, a zero-width recipe."""

from __future__ import annotations

import sys

import pytest

from witness.cli import main
from witness.task import build_task, registry


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    """An installed plugin whose module fails to import."""
    site = tmp_path / "site"
    (site / "witness_broken_demo").mkdir(parents=True)
    (site / "witness_broken_demo" / "__init__.py").write_text("import no_such_module_here\n")
    info = site / "witness_broken_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: witness-broken-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[witness.tasks]\nbroken = witness_broken_demo:Broken\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("witness_broken_demo", None)
    registry._built.cache_clear()


def test_a_plugin_that_does_not_import_is_named_not_a_traceback(broken_plugin, tmp_path, capsys):
    assert main(["train", "--task"]) == 0  # the list goes on, and says which one is unusable and why
    listed = capsys.readouterr().out
    assert "broken" in listed and "unusable" in listed and "No module named 'no_such_module_here'" in listed
    assert "tinygpt" in listed and "Traceback" not in listed
    code = main(["train", "--task", "broken", "--out", str(tmp_path / "run"), "--key", str(tmp_path / "k.pem"),
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be loaded" in err and "witness-broken-demo 0.1" in err and "Traceback" not in err


def test_the_example_plugins_install_no_generic_top_level_name(tmp_path):
    """`make setup` installs the examples' plugins; none may claim a name such as ``model``, ``run_clm``
    or ``train_lit``, which would shadow a user's own module of that name."""
    import subprocess
    from importlib.metadata import entry_points

    tops = {ep.dist.name: registry.top_level_names(ep.dist) for ep in entry_points(group="witness.tasks")
            if ep.dist is not None and ep.dist.name != "witness"}
    assert {"witness-nanogpt", "witness-example-clm", "witness-example-lightning"} <= set(tops), tops
    assert all(name.startswith("witness_") for names in tops.values() for name in names), tops
    (tmp_path / "model.py").write_text("WHOSE = 'mine'\n")  # a user's own model.py, imported from elsewhere
    (tmp_path / "pkg").mkdir()
    code = "import sys; sys.path.append(sys.argv[1]); import model, witness_nanogpt; print(model.WHOSE)"
    for name in ("model", "run_clm", "train_lit"):
        p = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path / "pkg", capture_output=True)
        assert p.returncode == 1 and b"ModuleNotFoundError" in p.stderr, (name, p.stderr)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path / "pkg", capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "mine", p.stderr


def test_a_run_that_stopped_before_its_first_step_can_be_started_again(tmp_path):
    from witness.commit.signing import generate_key
    from witness.record import Recorder

    out = tmp_path / "run"
    Recorder.create(build_task("tiny", {"steps": 4}), out, generate_key(), r=b"\x01" * 32)  # then it died
    assert (out / "log.jsonl").read_bytes().count(b"\n") == 1  # only the manifest
    args = ["train", "--task", "tiny", "--steps", "4", "--out", str(out), "--key", str(tmp_path / "k.pem"), "--quiet"]
    assert main(args) == 0
    # a run with a step recorded is kept: continuing it is --resume's
    assert main(args) == 2


def test_a_nonce_with_an_odd_number_of_digits_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path), "--nonce", "1ab"])
    assert e.value.code == 2 and "odd number of hex digits (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", str(tmp_path), "--nonce", "xyz"])
    assert "is not hex" in capsys.readouterr().err


def test_a_zero_width_recipe_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="hidden of task tiny must be at least 1"):
        build_task("tiny", {"hidden": 0})
    assert build_task("tiny", {"warmup": 0}).config.warmup == 0  # a step count may be 0
    code = main(["train", "--task", "tiny", "--config", "hidden=0", "--out", str(tmp_path / "r"),
                 "--key", str(tmp_path / "k.pem"), "--quiet"])
    assert code == 2 and "must be at least 1" in capsys.readouterr().err


def test_a_plugin_package_with_a_linked_folder_is_not_pinned_but_refused(tmp_path, monkeypatch):
    """Python imports through a linked folder inside a package, but the pin's walk does not descend
    into it: code there would change without changing the pin. Such a package is refused."""
    site = tmp_path / "site"
    pkg = site / "witness_linked_demo"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "layers.py").write_text("WIDTH = 4\n")
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import layers\n")
    (pkg / "sub").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    monkeypatch.syspath_prepend(str(site))
    try:
        with pytest.raises(ValueError, match="linked folder"):
            registry.package_files_sha256("witness_linked_demo")
    finally:
        sys.modules.pop("witness_linked_demo", None)
