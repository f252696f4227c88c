"""DDP and FSDP2 runs under `torchrun --nproc_per_node=2` (gloo, CPU), verified by one process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from witness.bundle.reader import open_bundle
from witness.bundle.state import default_digest, state_hash, state_tensors
from witness.commit.signing import generate_key, save_key
from witness.errors import RunRejected
from witness.session import TrainingSession
from witness.task import build_task
from witness.verify import Policy, Verifier
from witness.verify.challenges import draw_challenges

WORKER = Path(__file__).with_name("dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, key: Path, parallelism: str, *extra: str, ranks: int = 2, env: dict | None = None,
           script: Path = WORKER) -> subprocess.CompletedProcess:
    """``script`` (the worker by default) under torchrun on ``ranks`` ranks, whatever it exits with."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(script), "--parallelism", parallelism, "--out", str(out), "--key",
           str(key), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | env if env else None)


def torchrun(out: Path, key: Path, parallelism: str, *extra: str, ranks: int = 2, env: dict | None = None) -> Path:
    for attempt in range(2):  # a free port can be taken between choosing and binding it: retry once
        res = launch(out, key, parallelism, *extra, ranks=ranks, env=env)
        if res.returncode == 0 or "address already in use" not in res.stderr.lower() or attempt:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    key = d / "key.pem"
    save_key(generate_key(), key)
    return {
        "ddp": torchrun(d / "ddp", key, "ddp"),
        "fsdp": torchrun(d / "fsdp", key, "fsdp"),
        # these two hash their states off the training stream, as on a GPU (forced on here, on the
        # CPU): every rank its own rows, in a background thread
        "ddp_noclip": torchrun(d / "ddp_noclip", key, "ddp", "--grad-clip", "0", "--overlap"),
        "fsdp_noclip": torchrun(d / "fsdp_noclip", key, "fsdp", "--grad-clip", "0", "--overlap"),
        "key": key,
        "dir": d,
    }


def test_ddp_run_replays_bit_exactly_on_one_process(runs):
    b = open_bundle(runs["ddp"])
    assert (b.manifest.world_size, b.manifest.raw["parallelism"]) == (2, "ddp")
    v = Verifier(policy=Policy(challenges=100)).verify(runs["ddp"])
    assert v.accepted and v.exact and v.replayed_steps == 12


def test_fsdp_run_replays_bit_exactly_on_one_process(runs):
    # Clipping uses FSDP2's shard-by-shard gradient norm; replay reduces it the same way.
    for name in ("fsdp", "fsdp_noclip"):
        v = Verifier(policy=Policy(challenges=100)).verify(runs[name])
        assert v.accepted and v.exact and v.replayed_steps == 12, name
    # Tolerance mode, when asked for, reports every distance (all zero here) against its threshold.
    v = Verifier(policy=Policy(challenges=100, exact=False)).verify(runs["fsdp"])
    replayed = [r for r in v.results if r.replayed_steps]
    assert v.accepted and replayed and all(r.distances["fingerprint"] == r.distances["parameters"] == 0.0
                                           for r in replayed)


def test_state_hash_and_sketch_agree_across_single_process_ddp_and_fsdp(runs):
    ddp, fsdp = open_bundle(runs["ddp_noclip"]), open_bundle(runs["fsdp_noclip"])
    # each rank hashes its own rows (FSDP2's the shards it holds, DDP's a share of its replica):
    # the digest names the row shards, one per rank, and no rank hashes the whole state
    assert ddp.manifest.state_digest == fsdp.manifest.state_digest == f"{default_digest()}/2"
    assert [r.sketch for r in ddp.steps] == [r.sketch for r in fsdp.steps]
    assert [r.digest for r in ddp.steps] == [r.digest for r in fsdp.steps]
    assert all(r.state_hash for r in ddp.steps) and all(r.state_hash for r in fsdp.steps)  # every step, both
    # the same weights have one identity, however they were sharded
    assert ddp.end.final_model_hash == fsdp.end.final_model_hash
    # One process accumulating the two micro-batches reaches the same state and sketch at every
    # step, and its whole tensors hash to both runs' committed roots (which both runs hashed off
    # the training stream: their workers check that every record between checkpoints waited).
    m = ddp.manifest
    task = build_task("tiny", m.task_config)
    session = TrainingSession(task, m.run_seed, m.dataset_size, world_size=2)
    state = state_tensors(session.model, session.optimizer)
    assert state_hash(state, m.state_digest) == m.init_state_hash
    assert state_hash(state, fsdp.manifest.state_digest) == fsdp.manifest.init_state_hash
    ds = task.dataset()
    for rec, frec in zip(ddp.steps, fsdp.steps, strict=True):
        session.step(rec.step, [ds.sample_bytes(i) for i in rec.batch])
        assert session.sketch() == list(rec.sketch)
        state = state_tensors(session.model, session.optimizer)
        assert state_hash(state, m.state_digest) == rec.state_hash
        assert state_hash(state, fsdp.manifest.state_digest) == frec.state_hash


def test_fsdp_units_per_block_with_recomputed_activations_replay_bit_exactly(runs):
    # tinygpt under FSDP2: a unit per block (each reduce-scatters in rank order) and activation
    # checkpointing inside each block; one process, unsharded, replays every bit.
    out = torchrun(runs["dir"] / "gpt_fsdp", runs["key"], "fsdp", "--task", "tinygpt", "--steps", "4")
    m = open_bundle(out).manifest
    assert m.task_config["activation_checkpointing"] and m.state_digest.endswith("/2")
    v = Verifier(policy=Policy(challenges=100)).verify(out)
    assert v.accepted and v.exact and v.replayed_steps == 4, v.failures


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_rank_training_on_another_batch_is_rejected(runs, parallelism):
    out = torchrun(runs["dir"] / f"cheat_{parallelism}", runs["key"], parallelism, "--cheat-step", "6")
    with pytest.raises(RunRejected, match="step 6: replay"):
        Verifier(policy=Policy(challenges=100)).verify(out)
    head = open_bundle(out).final_head
    early = next(n.to_bytes(2, "big") for n in range(999)
                 if all(c.step < 4 for c in draw_challenges(head, n.to_bytes(2, "big"), 12, 2)))
    Verifier(policy=Policy(challenges=2, nonce=early)).verify(out)  # challenges before the checkpoint at 4 do not see step 6


# 8 ranks (2 run in the tests above): 4 told nothing 8 does not, and cost the suite 22 s
@pytest.mark.parametrize("parallelism,ranks", [("ddp", 8), ("fsdp", 8)])
def test_many_ranks_replay_bit_exactly_on_one_process(runs, parallelism, ranks):
    # The collectives would add the ranks' gradients (and FSDP2's clipping norm) in their own
    # order; the rank-ordered hook, reduce-scatter and norm make one process reproduce every bit.
    out = torchrun(runs["dir"] / f"{parallelism}{ranks}", runs["key"], parallelism, "--steps", "8",
                   "--checkpoint-every", "4", ranks=ranks)
    m = open_bundle(out).manifest
    assert (m.world_size, m.parallelism) == (ranks, parallelism)
    # every step's state is committed: each rank hashes its own rows, one shard each
    assert m.state_every == 1 and m.state_digest == f"{default_digest()}/{ranks}"
    v = Verifier(policy=Policy(challenges=100)).verify(out)
    assert v.accepted and v.exact and v.replayed_steps == 8 and not v.thresholds, v.failures


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_run_killed_mid_way_resumes_under_torchrun_and_verifies(runs, parallelism):
    out = runs["dir"] / f"killed_{parallelism}"
    res = launch(out, runs["key"], parallelism, "--die-after", "6")
    assert res.returncode != 0  # rank 0 was killed (SIGKILL) after step 6's record
    before = open_bundle(out)
    assert not before.complete and before.final_head.size <= 8
    # every rank reopens at the checkpoint after step 3 and loads it (FSDP2: its rows, its moments placed
    # as their parameters); steps 4..6, signed or not, are trained again and come out as recorded
    torchrun(out, runs["key"], parallelism, "--resume")
    after = open_bundle(out)
    assert after.complete and [h.root for h in after.heads[:len(before.heads)]] == [h.root for h in before.heads]
    v = Verifier(policy=Policy(challenges=100)).verify(out)
    assert v.accepted and v.exact and v.replayed_steps == 12, v.failures


@pytest.mark.parametrize("how", ["in process", "in the background"])
def test_the_self_check_stops_a_ddp_run_whose_rank_1_nudged_its_weights(runs, how):
    # rank 0 replays the step as the verifier will (both ranks' micro-batches, in rank order, from its own
    # replica); rank 1 trained its micro-batch on nudged weights, so the averaged update is not the replayed one
    out = runs["dir"] / f"nudged_{how.replace(' ', '_')}"
    steps = ["--check-steps", "0,5"] if how == "in process" else ["--check-steps", "0", "--sampled", "5"]
    res = launch(out, runs["key"], "ddp", "--nudge-step", "5", *steps)
    assert res.returncode != 0 and "step 5 does not replay" in res.stderr, res.stderr[-3000:]
    b = open_bundle(out)
    assert len(b.steps) <= 5  # nothing signed or kept from the step that did not replay on


def test_a_buffer_that_changes_while_training_is_refused_at_the_next_record():
    """DDP broadcasts rank 0's buffers and FSDP2 keeps each rank's: no one-process replay holds either."""
    import torch

    from witness.distributed.session import DistSession

    session = DistSession.__new__(DistSession)  # the check alone: a process group is not needed for it
    session.module = torch.nn.Module()
    session.module.register_buffer("ema", torch.zeros(3))
    session.module.register_buffer("mask", torch.ones(2, dtype=torch.bool))  # not floating: never compared
    session._buffers = {"ema": torch.zeros(3)}
    session.check_buffers()
    session.module.ema += 1
    with pytest.raises(NotImplementedError, match="changed its buffer ema"):
        session.check_buffers()
