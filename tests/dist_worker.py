"""Worker for the torchrun tests: a witnessed DDP or FSDP2 run of the tiny task, optionally dishonest."""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

from witness.commit.signing import load_key
from witness.distributed import DistRecorder, exit_now
from witness.record import Commitments, Online, OnlineSpec, SelfChecking
from witness.task import build_task


def online(args: argparse.Namespace, steps: int) -> Online | None:
    """Rank 0's online challenges: a beacon, or witnesses and drand (None: by WITNESS_BEACON, or none)."""
    if dist.get_rank() != 0 or not (args.beacon or args.witness):
        return Online(ring_bytes=args.ring_bytes) if args.ring_bytes else None
    if args.witness:
        from witness.beacon.drand import DrandClient
        from witness.beacon.windows import WitnessedLink
        from witness.beacon.witness_client import WitnessClient
        from witness.commit.drand import chain_info

        link = WitnessedLink([WitnessClient(u) for u in args.witness], DrandClient(args.drand, chain_info(args.drand_chain)))
        chain = link.chain.hash.hex()
    else:
        from witness.beacon.client import BeaconClient

        link, chain = BeaconClient(args.beacon), None
    spec = OnlineSpec.for_steps(steps, every=args.online_every, p=args.online_p, drand=chain)
    return Online(beacon=link, spec=spec, ring_bytes=args.ring_bytes)


def swap_rank1_rows(rec: DistRecorder, parallelism: str) -> None:
    """Other weights (a fixed draw) in rank 1's rows of every parameter: under FSDP2 the shards rank 1
    holds, under DDP the same rows of every rank's replica (the replicas stay equal)."""
    from witness.bundle.state import shard_rows

    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for _, p in rec.session.module.named_parameters():
            if parallelism == "fsdp":
                if dist.get_rank() == 1:
                    local = p.to_local()
                    local.copy_(torch.randn(local.shape, generator=g))
            elif p.dim():
                a, b = shard_rows(p.shape[0], dist.get_world_size())[1]
                p[a:b].copy_(torch.randn((b - a, *p.shape[1:]), generator=g))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallelism", required=True)
    ap.add_argument("--task", default="tiny", choices=["tiny", "tinygpt"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cheat-step", type=int, default=-1, help="at this step rank 1 trains on another batch")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--state-every", type=int, default=1)
    ap.add_argument("--overlap", action="store_true", help="hash the state off the training stream, as on a GPU")
    ap.add_argument("--beacon", help="online challenges from this beacon (else WITNESS_BEACON's, if set)")
    ap.add_argument("--witness", action="append", default=[], help="online challenges from these witnesses ...")
    ap.add_argument("--drand", help="... and this drand endpoint, whose chain info is --drand-chain")
    ap.add_argument("--drand-chain")
    ap.add_argument("--online-p", type=float, default=0.25)
    ap.add_argument("--online-every", type=int, default=4)
    ap.add_argument("--ring-bytes", type=int, help="each rank's ring budget")
    ap.add_argument("--seed-hex", default="2a" * 32, help="the run's r (hex)")
    ap.add_argument("--swap-step", type=int, default=-1,
                    help="after this step's update rank 1 swaps other weights into its rows of the parameters")
    ap.add_argument("--nudge-step", type=int, default=-1, help="before this step rank 1 nudges its weights")
    ap.add_argument("--check-steps", help="rank 0's self-check replays these steps (comma-separated) in process")
    ap.add_argument("--sampled", help="... and these in the background")
    ap.add_argument("--die-after", type=int, default=-1, help="rank 0 is killed (SIGKILL) after this step's record")
    ap.add_argument("--resume", action="store_true", help="continue the killed run in --out")
    ap.add_argument("--report", help="write this rank's online cost here (JSON), with the rank appended")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if args.task == "tinygpt":  # FSDP2 units per block, each recomputed in the backward pass
        task = build_task("tinygpt", {"steps": args.steps, "batch_size": 4, "block": 16, "n_layer": 2, "d_model": 16,
                                      "n_head": 2, "dropout": 0.0, "probes": 2, "probe_len": 8, "grad_clip": args.grad_clip,
                                      "corpus_max_bytes": 50_000, "activation_checkpointing": True})
    else:
        task = build_task("tiny", {"steps": args.steps, "batch_size": 16, "grad_clip": args.grad_clip})  # 16 splits over 1, 2, 4 ranks
    key = load_key(args.key) if dist.get_rank() == 0 else None
    if args.resume:
        rec = DistRecorder.resume(args.out, key)
    else:
        rec = DistRecorder(task, args.out, key, r=bytes.fromhex(args.seed_hex),
                           commit=Commitments(checkpoint_every=args.checkpoint_every, state_every=args.state_every),
                           parallelism=args.parallelism, online=online(args, task.config.steps),
                           # a dishonest run turns its own aid off: its self-check would stop it at the cheating step
                           self_check=SelfChecking(enabled=args.cheat_step < 0 and args.swap_step < 0))
    rec.overlap = args.overlap
    if rec.inner is not None and (args.check_steps or args.sampled):  # the self-check's steps, fixed
        from witness.record.selfcheck import SelfCheck

        steps = [int(x) for x in (args.check_steps or "").split(",") if x]
        rec.inner.self_check = SelfCheck(rec.inner, steps, sampled={int(x) for x in (args.sampled or "").split(",") if x})
        rec.inner.self_check.prepare(rec.start_step)
    if args.parallelism == "fsdp":  # the root, and a unit of its own for each block the task names
        from torch.distributed.fsdp import FSDPModule

        units = sum(isinstance(m, FSDPModule) for m in rec.model.modules())
        assert units == 1 + len(task.fsdp_units(rec.session.module)), units
    ds = task.dataset()
    for t in range(rec.start_step, args.steps):
        if t == args.nudge_step and dist.get_rank() == 1:  # its replica (or its shards) no longer the committed state
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(0.01)
        batch = rec.batch(t)
        if t == args.cheat_step and dist.get_rank() == 1:
            batch = task.collate([ds.sample_bytes(i) for i in range(100, 108)])
        out = rec.train_step(t, batch)
        if t == args.swap_step:  # other weights in rank 1's rows of every parameter (DDP: in every replica)
            swap_rank1_rows(rec, args.parallelism)
        rec.log_step(t, out)
        if t == args.die_after and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is flushed or closed
        if args.overlap and rec.inner is not None and rec.inner.state_due(t) and not rec.inner.checkpoint_due(t):
            assert rec.inner._deferred is not None, "the state hash did not go off the training stream"
            assert rec.sharded == (rec._unsettled is not None)
    rec.finish()
    if args.report:
        with open(f"{args.report}.{dist.get_rank()}", "w") as f:
            json.dump(rec.report(), f)
    left = rec.close()
    if args.parallelism == "ddp":  # nothing else holds the group: its threads were joined here
        assert not left, left
    if left:  # FSDP2: DTensor's caches hold the group; the interpreter's teardown must not join its threads
        exit_now()


if __name__ == "__main__":
    main()
