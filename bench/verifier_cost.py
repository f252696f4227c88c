"""Verifier cost against training cost, in one run, for 99% confidence against 5% bad steps.

Trains a small tinygpt run of N steps with the recorder (the whole training state committed at
every step), then audits it in both modes with q = 90 challenges (1 - 0.95^90 >= 0.99) and
reports time and replayed compute as fractions of the training. Interactive mode (the cheap
audit) replays one committed segment per challenge, q steps whatever N is; offline mode replays
from the checkpoint before each challenge. A second run commits the state every K steps only
(--state-every-k): the recorder hashes less, and each challenge replays a K-step segment.

    python bench/verifier_cost.py [--steps 10000] [--checkpoint-every 500] [--state-every-k 10] [--json out.json]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.bundle.state import state_hash, state_tensors
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder, SelfChecking
from witness.task import build_task
from witness.verify import Evidence, Policy, Verifier
from witness.verify.challenges import challenges_needed
from witness.verify.respond import respond

CONFIG = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8}


def run(args, tmp: Path, state_every: int, offline: bool) -> dict:
    """Train one run and audit it; the figures of both."""
    q = challenges_needed(0.99, 0.05)
    task = build_task("tinygpt", dict(CONFIG, steps=args.steps))
    run_dir, resp = tmp / f"run{state_every}", tmp / f"resp{state_every}"
    _ = task.dataset().root  # build the data commitment outside the timed training loop
    start = time.perf_counter()
    rec = Recorder.create(task, run_dir, generate_key(), r=b"\x02" * 32,
                          commit=Commitments(checkpoint_every=args.checkpoint_every, state_every=state_every),
                          self_check=SelfChecking(enabled=False))
    rec.train(progress=False)
    train_s = time.perf_counter() - start
    n = 50  # the recorder's state hash, measured alone on the final state
    start = time.perf_counter()
    for _ in range(n):
        state_hash(state_tensors(rec.model, rec.optimizer), rec.digest)
    hash_s = (time.perf_counter() - start) / n
    out = {"state_every": state_every, "train_s": train_s, "train_step_s": train_s / args.steps,
           "state_hash_s": hash_s, "state_digest": rec.digest,
           "trainer_hash_fraction": hash_s / state_every / (train_s / args.steps),
           "log_bytes_per_step": (run_dir / "log.jsonl").stat().st_size / args.steps}
    if offline:
        start = time.perf_counter()
        off = Verifier(policy=Policy(challenges=q, nonce=b"bench")).verify(run_dir)
        out["offline"] = {"verify_s": time.perf_counter() - start, "replayed_steps": off.replayed_steps,
                          "compute_fraction": off.cost_fraction}
        out["offline"]["time_fraction"] = out["offline"]["verify_s"] / train_s
    start = time.perf_counter()
    respond(run_dir, resp, nonce=b"bench", challenges=q)
    respond_s = time.perf_counter() - start
    start = time.perf_counter()
    inter = Verifier(policy=Policy(challenges=q, nonce=b"bench", mode="interactive")).verify(run_dir, Evidence(response=resp))
    verify_s = time.perf_counter() - start
    out["interactive"] = {"challenges": q, "detection_probability": inter.detection_probability,
                          "verify_s": verify_s, "time_fraction": verify_s / train_s,
                          "replayed_steps": inter.replayed_steps, "compute_fraction": inter.cost_fraction,
                          "trainer_respond_s": respond_s}
    shutil.rmtree(run_dir)
    shutil.rmtree(resp)
    return out


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--state-every-k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        every = run(args, Path(tmp), 1, offline=True)
        k = run(args, Path(tmp), args.state_every_k, offline=False)
    return report({"steps": args.steps, "checkpoint_every": args.checkpoint_every, "threads": args.threads,
                   "every_step": every, f"every_{args.state_every_k}": k,
                   "proof_of_learning_default_compute_fraction": 0.5}, args.json)


if __name__ == "__main__":
    main()
