"""Worker for the torchrun tests: a witnessed DDP or FSDP2 run of the tiny task, optionally dishonest."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from witness.commit.signing import load_key
from witness.distributed import DistRecorder, exit_now
from witness.record import Commitments
from witness.task import build_task


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
    rec = DistRecorder(task, args.out, key, r=b"\x2a" * 32,
                       commit=Commitments(checkpoint_every=args.checkpoint_every, state_every=args.state_every),
                       parallelism=args.parallelism)
    rec.overlap = args.overlap
    if args.parallelism == "fsdp":  # the root, and a unit of its own for each block the task names
        from torch.distributed.fsdp import FSDPModule

        units = sum(isinstance(m, FSDPModule) for m in rec.model.modules())
        assert units == 1 + len(task.fsdp_units(rec.session.module)), units
    ds = task.dataset()
    for t in range(args.steps):
        batch = rec.batch(t)
        if t == args.cheat_step and dist.get_rank() == 1:
            batch = task.collate([ds.sample_bytes(i) for i in range(100, 108)])
        rec.log_step(t, rec.train_step(t, batch))
        if args.overlap and rec.inner is not None and rec.inner.state_due(t) and not rec.inner.checkpoint_due(t):
            assert rec.inner._deferred is not None, "the state hash did not go off the training stream"
            assert rec.sharded == (rec._unsettled is not None)
    rec.finish()
    left = rec.close()
    if args.parallelism == "ddp":  # nothing else holds the group: its threads were joined here
        assert not left, left
    if left:  # FSDP2: DTensor's caches hold the group; the interpreter's teardown must not join its threads
        exit_now()


if __name__ == "__main__":
    main()
