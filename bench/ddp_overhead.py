"""Trainer overhead under DDP with 2 ranks (gloo, CPU): plain vs witnessed steps, one run.

Run with torchrun; rank 0 prints the figures:

    torchrun --nproc_per_node=2 bench/ddp_overhead.py [--json out.json]

Same tinygpt configuration as bench/overhead.py (global batch 64 x 128, probes 0.78 % of the
batch tokens), each rank with one thread. The recorder's added time per step is measured
directly inside the witnessed steps (batch root, collectives, fingerprint, sketch, state hash,
record) and compared with the plain DDP step; the witnessed step's gradient sum is rank-ordered
(an all-gather in a communication hook), and its training step alone is compared with the plain
one's default all-reduce.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parser, report
from overhead import CONFIG
from torch.nn.parallel import DistributedDataParallel

from witness.commit.signing import generate_key
from witness.distributed import DistRecorder
from witness.record import Commitments
from witness.task import build_task


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    task = build_task("tinygpt", CONFIG)
    tmp = tempfile.mkdtemp() if rank == 0 else None
    rec = DistRecorder(task, Path(tmp or ".") / "run", generate_key() if rank == 0 else None, r=b"\x04" * 32,
                       commit=Commitments(checkpoint_every=10**9), parallelism="ddp")
    plain = DistributedDataParallel(task.build_model(rec.session.run_seed))
    plain_opt = task.build_optimizer(plain)
    ds = task.dataset()
    tp = tw = 0
    plain_t, extra_t = [], []
    plain_train_t, ordered_train_t = [], []  # the steps alone: the default all-reduce against the rank-ordered hook

    def plain_step() -> float:
        nonlocal tp
        start = time.perf_counter()
        idx = rec.session.my_share(rec.session.batch_indices(tp))
        batch = task.collate([ds.sample_bytes(i) for i in idx])
        a = time.perf_counter()
        task.train_step(plain, plain_opt, batch, task.schedule.at(tp), tp)
        plain_train_t.append(time.perf_counter() - a)
        tp += 1
        return time.perf_counter() - start

    def witnessed_extra() -> float:
        nonlocal tw
        a = time.perf_counter()
        batch = rec.batch(tw)
        b = time.perf_counter()
        idx = rec.session.my_share(rec.session.batch_indices(tw))
        task.collate([ds.sample_bytes(i) for i in idx])  # what the plain step spends on its batch
        c = time.perf_counter()
        out = rec.train_step(tw, batch)
        d = time.perf_counter()
        ordered_train_t.append(d - c)
        rec.log_step(tw, out)
        e = time.perf_counter()
        tw += 1
        return (b - a) - (c - b) + (e - d)

    for _ in range(2):
        plain_step()
        witnessed_extra()
    for r in range(args.rounds):
        for path in (("p", "w") if r % 2 == 0 else ("w", "p")):
            for _ in range(args.block_steps):
                (plain_t if path == "p" else extra_t).append(plain_step() if path == "p" else witnessed_extra())
    # Rank 0 does the logging; the slowest rank sets the pace, so report rank 0's figures.
    if rank == 0:
        p, x = statistics.median(plain_t), statistics.median(extra_t)
        po, oo = statistics.median(plain_train_t[2:]), statistics.median(ordered_train_t[2:])
        report({"world_size": dist.get_world_size(), "plain_step_s": p, "recorder_added_s": x,
                "overhead_ratio": x / p, "plain_train_step_s": po, "rank_ordered_train_step_s": oo,
                "rank_ordered_reduction_ratio": oo / po - 1, "config": CONFIG}, args.json)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
