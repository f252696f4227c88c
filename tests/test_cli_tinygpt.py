"""The command line end to end, and tinygpt replayed bit-exactly in a fresh process at another thread count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import nonce_drawing_elsewhere

from witness.bundle.reader import open_bundle
from witness.task import build_task

SMALL = ["--config", "n_layer=1", "--config", "d_model=64", "--config", "batch_size=8",
         "--config", "corpus_max_bytes=400000", "--config", "warmup=4"]


def _cli(*args, threads: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run([sys.executable, "-m", "witness.cli", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    res = _cli("train", "--task", "tinygpt", "--steps", "16", "--checkpoint-every", "5", "--threads", "2",
               "--seed", "7", "--key", str(d / "key.pem"), "--out", str(d / "run"), "--quiet", *SMALL)
    assert res.returncode == 0, res.stderr
    return d / "run"


def test_tinygpt_replays_bit_exactly_with_another_thread_count(gpt_run):
    assert open_bundle(gpt_run).manifest.threads == 2
    res = _cli("verify", "--allow-weak", str(gpt_run), "--challenges", "16", "--threads", "1", "--json", threads=1)
    assert res.returncode == 0, res.stderr + res.stdout
    v = json.loads(res.stdout)
    assert v["accepted"] is True and v["exact"] is True and v["challenges"] == 16
    assert v["failures"] == [] and v["mode"] == "offline"
    assert v["detection_probability"] == 1.0  # all 16 steps replayed: nothing can have been missed
    assert v["replayed_steps"] == 16


def test_interactive_round_trip_through_the_cli(gpt_run, tmp_path):
    resp = tmp_path / "resp"
    res = _cli("respond", str(gpt_run), "--nonce", "abcd", "--challenges", "4", "--out", str(resp))
    assert res.returncode == 0, res.stderr
    res = _cli("verify", "--allow-weak", str(gpt_run), "--mode", "interactive", "--response", str(resp), "--nonce", "abcd",
               "--challenges", "4", "--json", "--threads", "1")
    assert res.returncode == 0, res.stderr
    v = json.loads(res.stdout)
    assert v["mode"] == "interactive" and v["replayed_steps"] == 4
    # Another nonce asks other questions: the old response does not answer them (which answer is
    # missing first, a state or a batch, depends on the run's random seed and so on the draw).
    other = nonce_drawing_elsewhere(gpt_run, bytes.fromhex("abcd"), 4).hex()
    res = _cli("verify", "--allow-weak", str(gpt_run), "--mode", "interactive", "--response", str(resp), "--nonce", other,
               "--challenges", "4", "--json")
    assert res.returncode == 1
    failure = json.loads(res.stdout)["failures"][0]
    assert "the response supplies no" in failure and "this audit's nonce" in failure, failure


def test_tolerance_mode_reports_every_threshold(gpt_run):
    res = _cli("verify", "--allow-weak", str(gpt_run), "--challenges", "3", "--tolerance", "--json")
    assert res.returncode == 0, res.stderr
    v = json.loads(res.stdout)
    assert v["exact"] is False
    assert set(v["thresholds"]) == {"loss", "fingerprint", "sketch", "update", "parameters", "buffers", "optimizer"}
    # every replayed segment compares each step, then the whole state at its end with the checkpoint
    whole = {"loss", "fingerprint", "sketch", "parameters", "optimizer.exp_avg", "optimizer.exp_avg_sq"}
    assert all(set(r["distances"]) >= whole for r in v["results"] if r["replayed_steps"])
    text = _cli("verify", "--allow-weak", str(gpt_run), "--challenges", "3", "--tolerance").stdout
    assert "fingerprint: max distance" in text and "against threshold" in text
    assert "parameters: max distance" in text and "optimizer: max distance" in text
    res = _cli("verify", "--allow-weak", str(gpt_run), "--challenges", "1", "--tolerance", "--threshold", "sketch=0.5", "--json")
    assert json.loads(res.stdout)["thresholds"]["sketch"] == 0.5
    assert _cli("verify", "--allow-weak", str(gpt_run), "--tolerance", "--threshold", "bogus=1").returncode == 2


def test_confidence_chooses_q_and_inspect_summarises(gpt_run):
    res = _cli("verify", "--allow-weak", str(gpt_run), "--confidence", "0.9", "--bad-fraction", "0.5", "--json")
    assert json.loads(res.stdout)["challenges"] == 4  # 1 - 0.5^4 >= 0.9
    res = _cli("inspect", str(gpt_run))
    assert res.returncode == 0 and "tinygpt run, 16/16 steps signed (complete)" in res.stdout
    assert "inspect neither hashes checkpoints nor replays anything" in res.stdout  # it says what it did not check
    info = json.loads(_cli("inspect", str(gpt_run), "--json").stdout)
    assert info["checkpoints"] == [0, 5, 10, 15, 16] and "neither hashes checkpoints" in info["checked"]


def test_keygen_refuses_to_overwrite(tmp_path):
    key = tmp_path / "k.pem"
    assert _cli("keygen", "--out", str(key)).returncode == 0
    assert key.with_suffix(".pub").exists()
    assert _cli("keygen", "--out", str(key)).returncode == 2


def test_init_weights_and_order_derive_from_the_seed():
    task = build_task("tiny")
    a, b = task.build_model(b"\x01" * 32), task.build_model(b"\x01" * 32)
    c = task.build_model(b"\x02" * 32)
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert any((p != q).any() for p, q in zip(a.parameters(), c.parameters(), strict=True))
