"""Every careless or hostile command-line input ends in exit 2 and a one-line message, never a
traceback (an uncaught exception exits 1, which reads as "rejected" or "different model")."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from witness.cli import main
from witness.errors import MalformedInput
from witness.verify.respond import respond

LONG = "x" * 5000


def _safetensors_with_metadata(path: Path, metadata) -> Path:  # noqa: ANN001 - any JSON value
    header = json.dumps({"__metadata__": metadata, "model.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\x00" * 4)
    return path


@pytest.fixture(scope="module")
def nested_endpoint():
    """A server whose outputs are JSON nested deeper than any parser recurses."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = b'{"outputs": ' + b"[" * 100_000 + b"]" * 100_000 + b', "shape": [1]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def places(honest_bundle, tmp_path_factory, nested_endpoint) -> dict[str, str]:
    """The paths and URLs the cases name."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "dir").mkdir()
    (tmp / "file").write_text("a file")
    answer = respond(honest_bundle, tmp / "answer", nonce=b"\x01", challenges=2)
    # the earliest state: the verifier always loads it (a later one it may replay into instead)
    state = sorted(answer.rglob("*.safetensors"))[0]
    _safetensors_with_metadata(state, "a string")
    return {"B": str(honest_bundle), "DIR": str(tmp / "dir"), "FILE": str(tmp / "file"), "OUT": str(tmp / "out"),
            "KEY": str(tmp / "key.pem"), "META_STR": str(_safetensors_with_metadata(tmp / "s.safetensors", "x")),
            "META_LIST": str(_safetensors_with_metadata(tmp / "l.safetensors", [1, 2])), "ANSWER": str(answer),
            "NESTED": nested_endpoint, "STORE": str(tmp / "store")}


TRAIN = ["train", "--task", "tiny", "--steps", "2", "--quiet"]
CASES = {
    "verify a 5000-character path": ["verify", LONG],
    "inspect a 5000-character path": ["inspect", LONG],
    "respond to a 5000-character path": ["respond", LONG, "--nonce", "00"],
    "identify weights at a 5000-character path": ["identify", "B", "--weights", LONG],
    "data include from a 5000-character path": ["data", "include", LONG, "--text", "x", "--out", "OUT"],
    "train into a 5000-character path": [*TRAIN, "--key", "KEY", "--out", LONG],
    "verify-eval a 5000-character path": ["verify-eval", LONG, "--bundle", "B"],
    "eval a 5000-character path": ["eval", LONG, "--out", "OUT", "--key", "KEY"],
    "a bad fraction of 1e-300": ["verify", "B", "--confidence", "0.99", "--bad-fraction", "1e-300"],
    "weights whose metadata is a string": ["identify", "B", "--weights", "META_STR"],
    "weights whose metadata is a list": ["identify", "B", "--weights", "META_LIST"],
    "a response state whose metadata is a string": ["verify", "B", "--mode", "interactive", "--response", "ANSWER",
                                                    "--nonce", "01", "--challenges", "2", "--json"],
    "train --key DIR": [*TRAIN, "--key", "DIR", "--out", "OUT"],
    "train --out FILE": [*TRAIN, "--key", "KEY", "--out", "FILE"],
    "data exclude --file DIR": ["data", "exclude", "B", "--file", "DIR", "--out", "OUT", "--key", "KEY"],
    "data exclude --out DIR": ["data", "exclude", "B", "--text", "never used", "--out", "DIR", "--key", "KEY"],
    "leaderboard serve --db mysql://x": ["leaderboard", "serve", "--db", "mysql://x", "--store", "STORE"],
    "leaderboard worker --db nonsense": ["leaderboard", "worker", "--db", "nonsense", "--store", "STORE", "--once"],
    "an endpoint answering deeply nested JSON": ["identify", "B", "--endpoint", "NESTED"],
    "a threshold of 1e999": ["verify", "B", "--tolerance", "--threshold", "loss=1e999"],
    "a threshold of NaN": ["verify", "B", "--tolerance", "--threshold", "loss=NaN"],
    "a threshold above 1": ["verify", "B", "--tolerance", "--threshold", "parameters=5"],
    "a million threads to verify": ["verify", "B", "--threads", "1000000"],
    "a million threads to train": [*TRAIN, "--key", "KEY", "--out", "OUT", "--threads", "1000000"],
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_ends_in_one_line_and_exit_2(case, places, capsys):
    argv = [places.get(a, a) for a in CASES[case]]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (case, code, err)
    # one line says what is wrong (a first run may say first that it creates the signing key)
    lines = [ln for ln in err.splitlines() if not ln.startswith("creating a signing key")]
    assert len(lines) == 1 and len(lines[0]) < 1200 and "Traceback" not in err, (case, err)


def test_no_case_gives_a_traceback_in_a_fresh_process(places, tmp_path):
    # the same through the installed entry point, for the two that once escaped the handler
    for case in ("a bad fraction of 1e-300", "train --key DIR"):
        argv = [places.get(a, a) for a in CASES[case]]
        r = subprocess.run([sys.executable, "-m", "witness.cli", *argv], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_full_disk_while_training_is_one_line_and_leaves_a_verifiable_prefix(tmp_path):
    # RLIMIT_FSIZE makes writes past a size fail (EFBIG) as a full disk would (ENOSPC) mid-run
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))\n"
        "from witness.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", script, "train", "--task", "tiny", "--steps", "60", "--quiet",
                        "--checkpoint-every", "5", "--key", str(tmp_path / "key.pem"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and "out of space" in lines[-1], r.stderr
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    # the signed prefix verifies; the run is incomplete, not dishonest
    v = subprocess.run([sys.executable, "-m", "witness.cli", "verify", "--allow-weak", str(out), "--challenges", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stderr
    verdict = json.loads(v.stdout)
    assert verdict["accepted"] and verdict["complete"] is False and 0 < verdict["steps"] < 60, v.stdout


@pytest.mark.parametrize("value", ["1.0", "1.5", "-0.1"])
def test_a_dropout_that_is_no_probability_is_refused_before_training(tmp_path, capsys, value):
    from witness.cli import main

    assert main(["train", "--task", "tinygpt", "--steps", "2", "--config", f"dropout={value}", "--out",
                 str(tmp_path / "r"), "--key", str(tmp_path / "k.pem"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "dropout is a probability in [0, 1)" in err or "config field dropout of task tinygpt is out of range" in err
    assert not (tmp_path / "r").exists()  # refused before anything was written, not blamed on the optimizer


def test_a_crash_is_exit_2_never_the_rejections_1(tmp_path, capsys, monkeypatch):
    """An error nothing foresaw (a task's own loader raising KeyError, say) ends any command with 2 and its
    traceback: 1 is a rejection's, which a crash never is (issue 52, loops item 3)."""
    from witness.cli import audit

    def crash(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyError("gpt2")

    monkeypatch.setattr(audit, "report_verdict", crash)  # what verify calls, looked up when it runs
    code = main(["verify", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "KeyError: 'gpt2'" in err and "nothing was decided (exit 2)" in err


def test_data_the_tasks_loader_chokes_on_is_not_the_data(monkeypatch):
    """Looking for the committed data, a loader that raises anything means it is not here: unusable input,
    said with the loader's error (a folder named like a transformers model type made one raise KeyError, and
    verify died; issue 52, loops item 3)."""
    from types import SimpleNamespace

    from witness.verify import finddata

    class Loader:
        @classmethod
        def from_config(cls, config):  # noqa: ANN001, ANN206
            return cls()

        def dataset(self):  # noqa: ANN202
            raise KeyError("gpt2")

    m = SimpleNamespace(task_config={}, dataset_size=4, data_root=b"\0" * 32, data_commitment="v1", raw={})
    with pytest.raises(MalformedInput, match="KeyError"):
        finddata.committed_dataset(Loader(), m)
