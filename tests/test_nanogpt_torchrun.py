"""nanoGPT's real train.py (examples/nanogpt) under `torchrun --standalone --nproc_per_node=2` on gloo:
the same witness lines as in one process, the loop's own DDP, each rank accumulating its share of the
micro-batches; one process verifies it offline and online. The attacks are a dishonest rank's: one that
changes its replica's weights between steps, and a loop that never averages the ranks' gradients."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import with_beacon
from test_nanogpt_real import prepared

from witness.bundle.layout import LOG
from witness.cli import main

SETTINGS = ["--backend=gloo", "--device=cpu", "--compile=False", "--dtype=float32", "--dataset=stdlib_char",
            "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=4",
            "--gradient_accumulation_steps=4", "--max_iters=7", "--dropout=0.2", "--eval_interval=4", "--eval_iters=2",
            "--log_interval=2", "--warmup_iters=2", "--lr_decay_iters=7", "--learning_rate=1e-3", "--min_lr=1e-4"]
START = "rec = start_run('nanogpt', config, os.path.join(out_dir, 'witness'), model=model, optimizer=optimizer, beacon=beacon)"


def torchrun(work: Path, *extra: str, script: str = "train.py") -> subprocess.CompletedProcess:
    """``script`` as nanoGPT's README starts it on one node, two ranks."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                           *SETTINGS, *extra], cwd=work, capture_output=True, text=True, timeout=600)


def dishonest(work: Path, name: str, start: str = START, after_step: str = "", drop_ddp: bool = False,
              change: tuple[str, str] | None = None) -> str:
    """A copy of train.py changed as a dishonest trainer (or a careless one) would change it."""
    text = (work / "train.py").read_text()
    assert START in text
    text = text.replace(START, start)
    if change:
        assert change[0] in text
        text = text.replace(*change)
    if after_step:
        text = text.replace("    scaler.update()\n", f"    scaler.update()\n{after_step}")
    if drop_ddp:
        text = text.replace("    model = DDP(", "    model = model if True else DDP(").replace("model.module if ddp", "model if ddp")
    (work / name).write_text(text)
    return name


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = prepared(tmp_path_factory, "nanogpt_torchrun")
    p = torchrun(work, "--out_dir=out")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "iter 6" in p.stdout and "saving checkpoint to out" in p.stdout  # nanoGPT's own loop, evals and all
    assert "bit for bit" in p.stderr  # rank 0's self-check replayed two steps as the verifier does
    return work


def test_the_run_is_two_ranks_accumulating_and_one_process_replays_every_step(work, capsys, monkeypatch):
    manifest = json.loads((work / "out" / "witness" / LOG).read_text().splitlines()[0])
    assert (manifest["world_size"], manifest["parallelism"]) == (2, "ddp")
    assert manifest["task_config"]["grad_accum"] == 4  # nanoGPT's setting before train.py divides it by 2
    monkeypatch.chdir(work)
    assert main(["verify", "out/witness", "--mode", "offline"]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED: nanogpt run of 8 steps" in out and "8 step(s) replayed = 100.00%" in out


def test_online_with_the_beacon(work, tmp_path, capsys):
    def train(url: str) -> None:
        p = torchrun(work, "--out_dir=online", f"--beacon={url}")
        assert p.returncode == 0, p.stderr[-3000:]

    key = with_beacon(tmp_path, train)
    assert main(["verify", "--allow-weak", str(work / "online" / "witness"), "--mode", "online",
                 "--beacon-key", key, "--data", str(work)]) == 0
    assert "ACCEPTED" in capsys.readouterr().out


def test_a_rank_that_changes_its_weights_between_steps_is_rejected(work, capsys):
    # rank 1 adds to a row of the output layer that rank 1 hashes (the second half of the rows) after step 3
    # is recorded; its self-check, which could have replayed that step, is off, as a cheat would have it
    nudge = ("    if ddp_rank == 1 and iter_num == 3:\n        with torch.no_grad(): "
             "raw_model.lm_head.weight[-1, 0] += 1e-3\n")
    script = dishonest(work, "cheat.py", START.replace("beacon=beacon)", "beacon=beacon, self_check=SelfChecking(enabled=False))")
                       .replace("rec =", "from witness.record import SelfChecking; rec ="), after_step=nudge)
    p = torchrun(work, "--out_dir=cheat", script=script)
    assert p.returncode == 0, p.stderr[-3000:]
    assert main(["verify", str(work / "cheat" / "witness"), "--mode", "offline", "--data", str(work)]) == 1
    assert "REJECTED: step 4" in capsys.readouterr().err  # replayed from the state committed after step 3


def test_a_loop_that_does_not_wrap_its_model_in_ddp_is_stopped_at_its_first_step(work):
    p = torchrun(work, "--out_dir=unwrapped", script=dishonest(work, "unwrapped.py", drop_ddp=True))
    assert p.returncode != 0
    assert "wrap the model start_run adopted in DistributedDataParallel" in p.stderr


def test_recorder_create_is_refused_under_torchrun(tmp_path):
    """Every rank would write the one bundle as a run of its own: the error names the two ways."""
    script = tmp_path / "create.py"
    script.write_text("import os, torch.distributed as dist\n"
                      "from witness.commit.signing import generate_key\n"
                      "from witness.record import Recorder\n"
                      "from witness.task import build_task\n"
                      "dist.init_process_group('gloo')\n"
                      "Recorder.create(build_task('tiny', {'steps': 2}), f'run{dist.get_rank()}', generate_key(), "
                      "r=bytes(32))\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "a torchrun process is recorded with start_run" in p.stderr


def test_a_loop_that_adds_the_gradients_at_every_micro_batch_is_stopped_before_its_first_backward(work):
    """A sum of averages rounds differently from the one sum a verifier replays: the error says what to do."""
    script = dishonest(work, "sync.py", change=("model.require_backward_grad_sync = (micro_step == "
                                                "gradient_accumulation_steps - 1)", "pass"))
    p = torchrun(work, "--out_dir=sync", script=script)
    assert p.returncode != 0
    assert "run the others under model.no_sync()" in p.stderr
    assert not (work / "sync" / "witness" / "checkpoints" / "00000001.safetensors").exists()


def test_a_manifest_that_claims_fsdp_for_an_accumulating_run_is_refused(work, tmp_path, capsys):
    """Accumulation over ranks has one replay rule, DDP's: a re-signed manifest claiming FSDP2 has none."""
    from helpers import edit_manifest

    from witness.commit.signing import load_or_create_key

    bundle = tmp_path / "forged"
    shutil.copytree(work / "out" / "witness", bundle)
    edit_manifest(bundle, load_or_create_key(work / "witness-key.pem"), parallelism="fsdp")
    assert main(["verify", str(bundle), "--mode", "offline", "--data", str(work)]) != 0
    assert "has no replay rule" in capsys.readouterr().err


def test_resuming_a_loop_of_its_own_says_it_is_not_built(work, tmp_path):
    script = tmp_path / "resume.py"
    script.write_text("import sys, torch.distributed as dist\n"
                      "from witness.distributed import DistRecorder\n"
                      "dist.init_process_group('gloo')\n"
                      "DistRecorder.resume(sys.argv[1], None)\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), str(work / "out" / "witness")], cwd=work, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0
    assert "is a loop of its own (start_run under torchrun): resuming one is not built" in p.stderr
