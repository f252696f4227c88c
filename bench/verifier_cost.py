"""Verifier cost against training cost, in one run, for 99% confidence against 5% bad steps.

Trains a small tinygpt run of N steps with the recorder, then audits it in both modes with
q = 90 challenges (1 - 0.95^90 >= 0.99) and reports time and replayed compute as fractions of
the training. Interactive mode's replay is q steps whatever N is; offline mode replays from
the checkpoint before each challenge.

    python bench/verifier_cost.py [--steps 10000] [--checkpoint-every 500] [--json out.json]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.commit.signing import generate_key
from witness.record import Recorder
from witness.task import build_task
from witness.verify import verify_bundle
from witness.verify.challenges import challenges_needed
from witness.verify.respond import respond

CONFIG = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8}


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q = challenges_needed(0.99, 0.05)
    task = build_task("tinygpt", dict(CONFIG, steps=args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        _ = task.dataset().root  # build the data commitment outside the timed training loop
        start = time.perf_counter()
        Recorder.create(task, run, generate_key(), r=b"\x02" * 32, checkpoint_every=args.checkpoint_every).train(progress=False)
        train_s = time.perf_counter() - start

        start = time.perf_counter()
        off = verify_bundle(run, challenges=q, nonce=b"bench")
        offline_s = time.perf_counter() - start

        start = time.perf_counter()
        respond(run, Path(tmp) / "resp", nonce=b"bench", challenges=q)
        respond_s = time.perf_counter() - start
        start = time.perf_counter()
        inter = verify_bundle(run, challenges=q, nonce=b"bench", mode="interactive", response=Path(tmp) / "resp")
        interactive_s = time.perf_counter() - start
        log_bytes = (run / "log.jsonl").stat().st_size
    out = {
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "challenges": q,
        "detection_probability": inter.detection_probability,
        "train_s": train_s,
        "offline": {"verify_s": offline_s, "time_fraction": offline_s / train_s,
                    "replayed_steps": off.replayed_steps, "compute_fraction": off.cost_fraction},
        "interactive": {"verify_s": interactive_s, "time_fraction": interactive_s / train_s,
                        "replayed_steps": inter.replayed_steps, "compute_fraction": inter.cost_fraction,
                        "trainer_respond_s": respond_s},
        "proof_of_learning_default_compute_fraction": 0.5,
        "log_bytes_per_step": log_bytes / args.steps,
    }
    return report(out, args.json)


if __name__ == "__main__":
    main()
