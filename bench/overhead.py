"""Trainer overhead of witnessing: plain vs witnessed tinygpt steps, interleaved in one run.

The configuration keeps the probe tokens at <= 1% of the batch tokens (4 probes x 16 tokens
against 64 x 128). Fingerprint, sketch and the hash of the whole training state are taken at
every step; checkpoint writes, which the trainer does anyway, are left out (no checkpoint falls
inside the measured steps).

    python bench/overhead.py [--rounds 6] [--block-steps 5] [--json out.json]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.bundle.state import state_hash, state_tensors
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder, SelfChecking
from witness.task import build_task

CONFIG = {"steps": 100_000, "batch_size": 64, "block": 128, "n_layer": 4, "d_model": 256, "n_head": 8,
          "probes": 4, "probe_len": 16}


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = build_task("tinygpt", CONFIG)
    probe_tokens = task.config.probes * task.config.probe_len
    batch_tokens = task.config.batch_size * task.config.block
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder.create(task, Path(tmp) / "run", generate_key(), r=b"\x01" * 32,
                              commit=Commitments(checkpoint_every=10**9),
                              self_check=SelfChecking(enabled=False))  # steady-state step cost only
        plain_model = task.build_model(rec.session.run_seed)
        plain_opt = task.build_optimizer(plain_model)
        ds = task.dataset()
        plain_t, wit_t = [], []
        t_plain = t_wit = 0
        # Warm-up both paths once (allocator, first epoch permutation).
        for _ in range(2):
            b = task.collate([ds.sample_bytes(i) for i in rec.batch_indices(t_plain)])
            task.train_step(plain_model, plain_opt, b, task.schedule.at(t_plain), t_plain)
            t_plain += 1
            b = rec.batch(t_wit)
            rec.log_step(t_wit, task.train_step(rec.model, rec.optimizer, b, rec.lr(t_wit), rec.step_seed(t_wit)))
            t_wit += 1
        extra_t = []  # time the recorder adds inside the witnessed steps (batch root, fingerprint, log)
        for r in range(args.rounds):
            # ABBA order cancels slow drift of the machine's speed.
            for path in (("plain", "witnessed") if r % 2 == 0 else ("witnessed", "plain")):
                start = time.perf_counter()
                if path == "plain":
                    for _ in range(args.block_steps):
                        b = task.collate([ds.sample_bytes(i) for i in rec.batch_indices(t_plain)])
                        task.train_step(plain_model, plain_opt, b, task.schedule.at(t_plain), t_plain)
                        t_plain += 1
                    plain_t.append((time.perf_counter() - start) / args.block_steps)
                    continue
                extra = 0.0
                for _ in range(args.block_steps):
                    a = time.perf_counter()
                    b = rec.batch(t_wit)
                    c0 = time.perf_counter()
                    collate_only = task.collate([ds.sample_bytes(i) for i in rec.batch_indices(t_wit)])
                    c1 = time.perf_counter()
                    del collate_only
                    out_ = task.train_step(rec.model, rec.optimizer, b, rec.lr(t_wit), rec.step_seed(t_wit))
                    d = time.perf_counter()
                    rec.log_step(t_wit, out_)
                    e = time.perf_counter()
                    extra += (c0 - a) - (c1 - c0) + (e - d)
                    start += c1 - c0  # the comparison collate is not part of the witnessed step
                    t_wit += 1
                wit_t.append((time.perf_counter() - start) / args.block_steps)
                extra_t.append(extra / args.block_steps)
        # The witnessing work alone, measured directly on the same state.
        n = 20
        start = time.perf_counter()
        for _ in range(n):
            rec.session.fingerprint()
        fp_s = (time.perf_counter() - start) / n
        start = time.perf_counter()
        for _ in range(n):
            rec.session.sketch()
        sk_s = (time.perf_counter() - start) / n
        start = time.perf_counter()
        for _ in range(n):
            state_hash(state_tensors(rec.model, rec.optimizer), rec.digest)
        sh_s = (time.perf_counter() - start) / n
        log_bytes = (Path(tmp) / "run" / "log.jsonl").stat().st_size
        records = t_wit
    plain, wit = statistics.median(plain_t), statistics.median(wit_t)
    out = {
        "config": CONFIG,
        "parameters": sum(p.numel() for p in plain_model.parameters()),
        "probe_tokens_fraction": probe_tokens / batch_tokens,
        "plain_step_s": plain,
        "witnessed_step_s": wit,
        "overhead_ratio_wallclock": wit / plain - 1,
        "recorder_added_s": statistics.median(extra_t),
        "overhead_ratio": statistics.median(extra_t) / plain,
        "fingerprint_s": fp_s,
        "sketch_s": sk_s,
        "state_hash_s": sh_s,
        "state_digest": rec.digest,
        "component_ratio": (fp_s + sk_s + sh_s) / plain,
        "log_bytes_per_step": log_bytes / (records + 1),
        "threads": args.threads,
    }
    return report(out, args.json)


if __name__ == "__main__":
    main()
    sys.exit(0)
