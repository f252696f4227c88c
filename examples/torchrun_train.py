"""A plain torchrun training script, witnessed with a few added lines (marked `# witness`).

    torchrun --nproc_per_node=2 examples/torchrun_train.py --parallelism ddp --out runs/ddp
    torchrun --nproc_per_node=2 examples/torchrun_train.py --parallelism fsdp --out runs/fsdp
    witness verify runs/ddp --challenges 20            # one process replays it bit for bit, any rank count

After a kill, the same command with ``--resume`` continues the run from its last intact checkpoint.

Online challenges need no change to the script: with ``WITNESS_BEACON=URL`` in the environment,
rank 0 streams the run's heads to that beacon and every rank keeps and writes its share of each
state the beacon selects (docs/distributed.md); ``witness verify runs/ddp --mode online
--beacon-key KEY`` then audits it.

It runs on the CPU with gloo (the nccl path for GPUs: docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from witness.commit.signing import load_or_create_key, secret_r  # witness
from witness.distributed import DistRecorder, exit_now  # witness
from witness.record import Commitments  # witness
from witness.task import build_task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="tinygpt")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (split over the ranks)")
    ap.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--out", required=True)
    ap.add_argument("--key", default=os.path.expanduser("~/.witness/signing_key.pem"))
    ap.add_argument("--seed", default="example")
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--resume", action="store_true", help="continue the killed run in --out")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    task = build_task(args.task, {"steps": args.steps, "batch_size": args.batch_size})
    key = load_or_create_key(args.key) if dist.get_rank() == 0 else None  # witness: rank 0 signs
    # witness: r from the seed text under rank 0's key (no one without the key can guess the run seed),
    # or a leaderboard ticket; every rank needs it (the data order and the initial weights follow from it)
    shared = [secret_r(args.seed, key) if key is not None else None]
    dist.broadcast_object_list(shared, src=0)
    r = shared[0]
    if args.resume:  # witness: every rank reloads the last intact checkpoint; signed steps come out again
        rec = DistRecorder.resume(args.out, key)
    else:
        rec = DistRecorder(task, args.out, key, r=r, commit=Commitments(checkpoint_every=args.checkpoint_every),  # witness
                           parallelism=args.parallelism)

    for step in range(rec.start_step, args.steps):
        batch = rec.batch(step)  # witness: this rank's share of the committed batch
        out = rec.train_step(step, batch)
        rec.log_step(step, out)  # witness
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step:5d}  loss {out.loss:.4f}", flush=True)
    rec.finish()  # witness
    if rec.close():  # witness: the process group torn down in order (instead of destroy_process_group)
        exit_now()  # witness: backend threads outlived it (FSDP2): skip the interpreter's teardown


if __name__ == "__main__":
    main()
