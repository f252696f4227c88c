"""Devices: the manifest records the hardware, exact replay insists on the same, other hardware
only in tolerance mode when the verifier asks; bf16 autocast replays bit for bit; the device code
paths run on the CPU here, and the GPU tests run where torch sees a CUDA device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import edit_manifest, train_tiny

from witness.bundle.reader import open_bundle
from witness.bundle.state import state_hash, state_tensors
from witness.cli import main
from witness.commit.signing import load_key
from witness.errors import MalformedInput, VerificationError
from witness.session import TrainingSession, deterministic_device, device_info, same_hardware
from witness.task import build_task
from witness.task.base import to_device
from witness.task.tinygpt import Block
from witness.verify import Policy, Verifier

H200 = {"kind": "cuda", "name": "NVIDIA H200", "cuda": "13.0", "cudnn": "91000", "driver": "580.65"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none is visible to torch here)")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory, signing_key):
    """A small tinygpt run in bf16 autocast (CPU autocast: the same code path as on a GPU)."""
    out = tmp_path_factory.mktemp("device") / "run"
    return train_tiny(out, signing_key, task="tinygpt", checkpoint_every=4,
                      config={"steps": 8, "batch_size": 4, "block": 32, "n_layer": 1, "d_model": 32,
                              "n_head": 2, "precision": "bf16", "corpus_max_bytes": 200_000})


def test_the_manifest_records_the_hardware(gpt):
    m = open_bundle(gpt).manifest
    assert m.device == device_info("cpu") and m.device["kind"] == "cpu" and m.device["machine"]
    assert m.task_config["precision"] == "bf16"


def test_a_bf16_run_replays_bit_for_bit(gpt):
    v = Verifier(policy=Policy(challenges=8, nonce=b"\x01")).verify(gpt)
    assert v.accepted and v.replayed_steps == 8 and not v.thresholds
    assert any("replayed on the run's own hardware, the CPU" in c for c in v.checks)


def test_bf16_differs_from_fp32():
    # autocast is really on: the same step in fp32 lands elsewhere
    losses = {}
    for precision in ("fp32", "bf16"):
        task = build_task("tinygpt", {"steps": 2, "batch_size": 2, "block": 16, "n_layer": 1, "d_model": 16,
                                      "n_head": 2, "precision": precision, "corpus_max_bytes": 50_000})
        s = TrainingSession(task, b"\x01" * 32, len(task.dataset()))
        losses[precision] = s.step(0, [task.dataset().sample_bytes(i) for i in s.batch_indices(0)]).loss
    assert losses["fp32"] != losses["bf16"]
    with pytest.raises(ValueError, match="precision"):
        build_task("tinygpt", {"precision": "fp8"})


def test_activation_checkpointing_recomputes_the_same_bits(monkeypatch):
    # a memory setting, not a change of arithmetic: every record and the state come out the same
    base = {"steps": 3, "batch_size": 2, "block": 16, "n_layer": 2, "d_model": 16, "n_head": 2, "dropout": 0.0,
            "precision": "bf16", "corpus_max_bytes": 50_000}
    runs = {}
    calls = []
    compute = Block.compute
    monkeypatch.setattr(Block, "compute", lambda self, *a: calls.append(1) or compute(self, *a))
    for recompute in (False, True):
        task = build_task("tinygpt", dict(base, activation_checkpointing=recompute))
        s = TrainingSession(task, b"\x01" * 32, len(task.dataset()))
        calls.clear()
        outs = [s.step(t, [task.dataset().sample_bytes(i) for i in s.batch_indices(t)]) for t in range(3)]
        fp = s.fingerprint().digest  # probes run without gradients: nothing to recompute
        runs[recompute] = ([(o.loss, o.grad_norm) for o in outs], fp,
                           state_hash(state_tensors(s.model, s.optimizer), "sha256"), len(calls))
    assert runs[True][:3] == runs[False][:3]
    # two blocks: a forward each per step and per probe pass, and a recomputation each per backward
    assert runs[False][3] == 2 * (3 + 1) and runs[True][3] == 2 * (2 * 3 + 1)
    # the field came after runs were recorded without it: their recipes stay canonical
    assert "activation_checkpointing" not in build_task("tinygpt", base).config_json()
    assert build_task("tinygpt", dict(base, activation_checkpointing=True)).config_json()["activation_checkpointing"]
    with pytest.raises(ValueError, match="activation_checkpointing needs dropout 0"):
        build_task("tinygpt", dict(base, activation_checkpointing=True, dropout=0.1))


def test_a_run_from_other_hardware_replays_only_in_tolerance_mode(gpt, signing_key, tmp_path, capsys):
    bundle = tmp_path / "b"
    shutil.copytree(gpt, bundle)
    m = open_bundle(gpt).manifest.raw
    edit_manifest(bundle, signing_key, versions=dict(m["versions"], device=H200))
    with pytest.raises(MalformedInput, match="recorded on NVIDIA H200 .* needs the same hardware .*--device cuda"):
        Verifier(policy=Policy(challenges=3)).verify(bundle)
    assert main(["verify", str(bundle), "--challenges", "3"]) == 2
    assert "--tolerance" in capsys.readouterr().err
    # the claim buys nothing: the CPU replay still has to land within the thresholds on every state
    v = Verifier(policy=Policy(challenges=3, exact=False, nonce=b"\x02")).verify(bundle)
    assert v.accepted and any("recorded on NVIDIA H200" in n and "tolerance mode" in n for n in v.notes)


def test_a_recipe_naming_a_later_field_at_its_default_is_not_canonical(gpt, signing_key, tmp_path):
    # one recipe, one form: the field added later is left out at its default, never written out
    bundle = tmp_path / "b"
    shutil.copytree(gpt, bundle)
    config = open_bundle(gpt).manifest.task_config
    edit_manifest(bundle, signing_key, task_config=dict(config, activation_checkpointing=False))
    with pytest.raises(VerificationError, match="not in canonical form"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)


def test_a_false_device_record_is_malformed(gpt, signing_key, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(gpt, bundle)
    m = open_bundle(gpt).manifest.raw
    edit_manifest(bundle, signing_key, versions=dict(m["versions"], device={"kind": "tpu"}))
    with pytest.raises(MalformedInput, match="kind must be cpu or cuda"):
        open_bundle(bundle)
    edit_manifest(bundle, signing_key, versions=dict(m["versions"], device={"kind": "cpu", "x": "y"}))
    with pytest.raises(MalformedInput, match="unexpected fields"):
        open_bundle(bundle)


def test_hardware_comparison():
    cpu = device_info("cpu")
    assert same_hardware(cpu, cpu) and same_hardware({"kind": "cpu"}, cpu)  # older manifests name no machine
    assert not same_hardware(dict(cpu, machine="aarch64"), cpu)
    assert "kernels" in cpu and not same_hardware(dict(cpu, kernels="GenuineIntel AVX512 avx512f"), cpu)
    assert same_hardware({"kind": "cpu", "machine": cpu["machine"]}, cpu)  # recorded before kernels were
    assert not same_hardware(H200, cpu) and same_hardware(H200, dict(H200, driver="590.1"))  # the driver picks no kernel
    assert not same_hardware(H200, dict(H200, name="NVIDIA A100-SXM4-80GB"))
    assert not same_hardware(dict(H200, kernels="AuthenticAMD AVX2"), dict(H200, kernels="GenuineIntel AVX512"))


def test_batches_move_to_the_device_in_any_shape():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(3)]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["x"] is batch["x"] and moved["n"] == 3 and isinstance(moved["pair"], tuple)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_a_gpu_without_one_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        deterministic_device("cuda")
    code = main(["train", "--task", "tiny", "--steps", "2", "--device", "cuda", "--quiet",
                 "--key", str(tmp_path / "k.pem"), "--out", str(tmp_path / "run")])
    assert code == 2 and "no CUDA GPU" in capsys.readouterr().err


@needs_cuda
def test_a_gpu_run_replays_bit_for_bit_on_the_gpu_and_in_tolerance_on_the_cpu(tmp_path, capsys):
    key = str(tmp_path / "k.pem")
    args = ["train", "--task", "tinygpt", "--steps", "6", "--checkpoint-every", "3", "--device", "cuda", "--quiet",
            "--config", "batch_size=8", "--config", "precision=bf16", "--config", "dropout=0.0",
            "--key", key, "--out", str(tmp_path / "run")]
    assert main(args) == 0
    m = open_bundle(tmp_path / "run").manifest
    assert m.device["kind"] == "cuda" and m.device["name"] == torch.cuda.get_device_name()
    v = Verifier(policy=Policy(challenges=6, device="cuda")).verify(tmp_path / "run")
    assert v.accepted and any("bit for bit" in c for c in v.checks)
    with pytest.raises(MalformedInput, match="same hardware"):
        Verifier(policy=Policy(challenges=2)).verify(tmp_path / "run")
    drift = Verifier(policy=Policy(challenges=6, exact=False)).verify(tmp_path / "run")
    assert drift.accepted and drift.thresholds


def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    # The benchmark's only real run is on a GPU someone lends: its smoke test keeps it working here.
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "gpu_witnessed.py", "--device", "cpu", "--small", "--steps", "4", "--drift-steps", "2", "--json", str(out)]
    res = subprocess.run(cmd, cwd=root / "bench", capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert res.returncode == 0, res.stderr[-3000:]
    figures = json.loads(out.read_text())
    (run,), (drift,) = figures["runs"], figures["drift"]
    assert "error" not in run and "error" not in drift, (run.get("traceback"), drift.get("traceback"))
    assert run["replay"]["replay_exact"] and run["replay"]["replayed_steps"] == 4 and run["state_every"] == 1
    assert set(run["parts_s"]) == {"loss all-gather", "fingerprint", "sketch", "state", "record"}
    assert drift["accepted"] and len(drift["segments"]) == 2 and drift["max_distance"]["parameters"] == 0.0


def test_a_cpu_that_picks_other_kernels_is_other_hardware(tmp_path, capsys):
    # ATen's portable kernels stand for another CPU: they draw the initial weights and step with
    # other roundings, so a verifier on this CPU cannot replay the run exactly. The manifest says
    # which kernels it used, and exact replay is refused (exit 2), never called dishonest.
    other = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    key, run = tmp_path / "k.pem", tmp_path / "run"
    train = [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", "4", "--checkpoint-every", "2",
             "--threads", "1", "--quiet", "--key", str(key), "--out", str(run)]
    assert subprocess.run(train, env=other, capture_output=True, timeout=300).returncode == 0
    recorded = open_bundle(run).manifest.device
    assert " DEFAULT" in recorded["kernels"] and recorded["kernels"] != device_info("cpu")["kernels"]
    with pytest.raises(MalformedInput, match="needs the same hardware .*--tolerance"):
        Verifier(policy=Policy(challenges=4)).verify(run)
    assert main(["verify", str(run), "--challenges", "4"]) == 2
    assert "DEFAULT" in capsys.readouterr().err
    # tolerance mode replays it here: the seed's weights, drawn by this CPU, lie within the thresholds
    v = Verifier(policy=Policy(challenges=4, exact=False)).verify(run)
    assert v.accepted and any("initial state within tolerance" in c for c in v.checks), v.checks
    # on a CPU that picks the same kernels, it replays bit for bit
    verify = [sys.executable, "-m", "witness.cli", "verify", str(run), "--challenges", "4", "--json"]
    r = subprocess.run(verify, env=other, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["accepted"], r.stderr
    # why it is refused: with the kernels left out (as witness before 0.4.0 wrote it) this CPU
    # would call the honest run dishonest at its very first state
    edit_manifest(run, load_key(key), versions=dict(open_bundle(run).manifest.raw["versions"],
                                                    device={"kind": "cpu", "machine": recorded["machine"]}))
    with pytest.raises(VerificationError, match="initial state is not the one the run seed generates"):
        Verifier(policy=Policy(challenges=4)).verify(run)


def test_a_gpu_run_pins_its_collectives_and_tuning_and_refuses_fast_fp8(monkeypatch):
    """What deterministic_device sets on a GPU, checked here without one: NCCL's algorithm and protocol,
    NVLS and CollNet off, autotuning off (set where unset, recorded as in effect), and an FP8 product with
    fast accumulation refused where it is called; a GPU run from other pins is other hardware."""
    from witness import session as sess

    for k in sess.COLLECTIVE_PINS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL128")  # a run's own choice stays, and is what the manifest names
    sess.pin_collectives_and_tuning()
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert sess.collective_pins() == "algo=Ring proto=LL128 nvls=0 collnet=0 autotune=0 cd_tuning=0"
    assert len(sess.collective_pins()) <= 128
    from torch._inductor import config as inductor

    assert not inductor.max_autotune and not inductor.coordinate_descent_tuning
    monkeypatch.setattr(torch, "_scaled_mm", torch._scaled_mm)  # restored after the test
    sess.refuse_fast_fp8()
    sess.refuse_fast_fp8()  # once is enough: not wrapped twice
    assert torch._scaled_mm._witness_guard
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="use_fast_accum=True does not replay exactly"):
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32, use_fast_accum=True)
    with pytest.raises(RuntimeError, match="use_fast_accum=True does not replay exactly"):
        torch._scaled_mm(a, a.t(), one, one, None, None, torch.float32, True)
    gpu = {"kind": "cuda", "name": "H100", "cuda": "12.8", "cudnn": "9", "kernels": "x", "nccl": "2.27.3",
           "pins": sess.collective_pins()}
    assert sess.same_hardware(gpu, gpu)
    assert not sess.same_hardware(gpu, gpu | {"pins": "algo=Tree proto=Simple nvls=0 collnet=0 autotune=0 cd_tuning=0"})
    assert not sess.same_hardware(gpu, gpu | {"nccl": "2.21.5"})


@needs_cuda
def test_a_gpu_state_hashed_by_the_kernels_is_the_hosts_state_tree():
    """On a GPU (scripts/gpu_check.sh): a real training state after an AdamW step, its moments on the device
    and its step counters on the host, hashed by the Triton kernels where each tensor lies, is the host's
    state tree, and every chunk opens the same."""
    import numpy as np

    from witness.bundle.opened import StateTree, hasher_for
    from witness.bundle.state import state_tensors
    from witness.fingerprint.chunks import ChunkLayout

    pytest.importorskip("triton")
    model = torch.nn.Sequential(torch.nn.Linear(256, 300), torch.nn.Linear(300, 7)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    tensors = state_tensors(model, opt)
    assert any(t.device.type == "cpu" for t in tensors.values())  # (AdamW's step counters)
    layout = ChunkLayout.of_model(model)
    flat = layout.flatten({k: v.cpu() for k, v in tensors.items()})
    host = StateTree({k: v.cpu() for k, v in tensors.items()}, "blake3", layout, flat)
    device = StateTree(tensors, "blake3", layout, flat, hasher_for(torch.device("cuda")))
    assert device.root == host.root
    chunks = list(range(layout.size))
    assert np.array_equal(device.paths(chunks), host.paths(chunks))
