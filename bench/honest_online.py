"""Honest online runs never trip the bounded-move check: many runs, every kind of step, no false rejection.

Each run trains with a beacon of its own (in-process), commits its parameters' chunks and opens them
for every step of every window, and is audited online; an honest run that is rejected is a bug. The
runs cycle through recipes that stress the bound: warm-up from the first step (B_1 = 1: a step with a
gradient moves every coordinate by lr), gradient clipping, gradient accumulation, fp16 with a
GradScaler (skipped steps move nothing), AdamW with betas (0.9, 0.999) (B_t up to 7.27), Adam with L2
decay, BatchNorm (tinycnn, the CNN plugin), the nanogpt-style plugin, the overlapped state hash (the
GPU path, on the CPU), audits in tolerance mode, and parameters a step does not update (a frozen
embedding in an AdamW decay group at decay 0.1 and 1.0, requires_grad toggled mid-run, a branch a
step does not use, fp16 skipped steps at decay 1.0). Each run has its own r (seed), so its own data
order, initialisation and draws. Reported: runs, false rejections (with their reasons), the largest
move any run made as a fraction of its step's bound, and the runs whose verdict names a step the move
check cannot discriminate (a blind step or a spike: an honest schedule should name none).

    python bench/honest_online.py [--runs 200] [--json out.json]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from common import parser, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from starlette.testclient import TestClient  # noqa: E402

from witness.beacon.app import create_app  # noqa: E402
from witness.beacon.client import BeaconClient  # noqa: E402
from witness.commit.signing import generate_key, public_hex  # noqa: E402
from witness.data.locate import data_dirs  # noqa: E402
from witness.errors import VerificationError  # noqa: E402
from witness.record import Commitments, Online, Recorder, SelfChecking  # noqa: E402
from witness.record.online import OnlineSpec  # noqa: E402
from witness.task import build_task, registry  # noqa: E402
from witness.verify import Policy, Trust, Verifier  # noqa: E402

SMALL = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8,
         "corpus_max_bytes": 300_000}
# (name, task, recipe, recorder options, verifier options)
RECIPES = [
    ("tiny, warm-up from step 1", "tiny", {"steps": 24}, {}, {}),
    ("tinygpt, warm-up and clipping", "tinygpt", SMALL | {"steps": 30, "warmup": 10, "grad_clip": 0.5}, {}, {}),
    ("tinygpt, accumulation of 2", "tinygpt", SMALL | {"steps": 24, "grad_accum": 2, "warmup": 5}, {}, {}),
    ("tinygpt, lr 0.02, no clipping", "tinygpt", SMALL | {"steps": 24, "lr": 0.02, "grad_clip": 0.0, "warmup": 1},
     {}, {}),
    ("tinycnn (BatchNorm)", "tinycnn", {"steps": 20}, {}, {}),
    ("example-cnn, AdamW betas (0.9, 0.999)", "example-cnn",
     {"steps": 20, "optimizer_args": {"betas": [0.9, 0.999]}}, {}, {}),
    ("example-cnn, Adam with L2 decay", "example-cnn",
     {"steps": 20, "optimizer": "Adam", "weight_decay": 0.05}, {}, {}),
    ("nanogpt-style plugin", "nanogpt-style", {"steps": 20, "batch_size": 4, "data": "train.bin"}, {}, {}),
    ("fp16 with a GradScaler (skipped steps)", "fp16-test",
     {"steps": 16, "batch_size": 8, "precision": "fp16", "lr": 0.01}, {}, {}),
    ("tiny, overlapped state hash (the GPU path)", "tiny", {"steps": 24}, {"overlap": True}, {}),
    ("tiny, audited in tolerance mode", "tiny", {"steps": 24}, {}, {"exact": False}),
    # parameters a step does not update (torch skips them, decay and all): issue 46's honest cases
    ("frozen embedding in a decay group, decay 0.1", "frozen-lookup-test", {"steps": 16, "weight_decay": 0.1}, {}, {}),
    ("frozen embedding in a decay group, decay 1.0", "frozen-lookup-test", {"steps": 16}, {}, {}),
    ("requires_grad toggled mid-run", "unfreezing-test", {"steps": 16}, {}, {}),
    ("a branch a step does not use", "branchy-test", {"steps": 16}, {}, {}),
    ("fp16 skipped steps, decay 1.0", "fp16-skips-test", {"steps": 16, "precision": "fp16", "lr": 0.01}, {}, {}),
]


def _register_test_tasks() -> None:
    # the suite's own: fp16 (its first steps overflow and are skipped) and the parameters a step leaves alone
    from test_fp16 import HalfTask
    from test_honest_moves import TASKS

    for cls in (HalfTask, *TASKS):
        registry.BUILTIN[cls.name] = cls
    registry._built.cache_clear()


def one_run(folder: Path, task_name: str, recipe: dict, rec_opts: dict, verify_opts: dict) -> dict:
    """Train one honest online run and audit it; what the audit found."""
    folder.mkdir(parents=True)
    key = generate_key()
    http = TestClient(create_app(f"sqlite:///{folder / 'beacon.db'}", key))
    task = build_task(task_name, recipe)
    rec = Recorder.create(task, folder / "run", generate_key(), r=os.urandom(32),
                          commit=Commitments(checkpoint_every=max(2, task.config.steps // 4)),
                          online=Online(beacon=BeaconClient(http), spec=OnlineSpec(0.25, 4, 9)),
                          self_check=SelfChecking(enabled=False))
    if rec_opts.get("overlap"):
        rec.overlap = True
    rec.train(progress=False)
    try:
        trust = Trust(beacon_key=public_hex(key.public_key()))
        v = Verifier(trust, Policy(mode="online", **verify_opts)).verify(folder / "run")
        return {"rejected": False, "worst": v.moves["worst"], "slack_used": v.moves["slack_used"], "checked": v.moves["checked"],
                "named": bool(v.moves["blind"] or v.moves["spikes"]),  # a step the verdict says it cannot discriminate
                "skipped": sum(1 for line in (folder / "run" / "log.jsonl").read_text().splitlines()[1:]
                               if '"grad_norm":"inf"' in line or '"grad_norm":"nan"' in line)}
    except VerificationError as e:
        return {"rejected": True, "why": str(e)[:300]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    _register_test_tasks()
    started = time.perf_counter()
    per: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        data.mkdir()
        tokens = np.frombuffer(b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:40]),
                               dtype=np.uint8).astype(np.uint16)
        tokens.tofile(data / "train.bin")
        with data_dirs([data]):
            for i in range(args.runs):
                name, task, recipe, rec_opts, verify_opts = RECIPES[i % len(RECIPES)]
                per[name].append(one_run(tmp / f"run{i}", task, recipe, rec_opts, verify_opts))
    rows = {name: {"runs": len(r), "false_rejections": sum(x["rejected"] for x in r),
                   "worst_move_of_bound": max((x.get("worst", 0.0) for x in r), default=0.0),
                   "most_rounding_slack_used": max((x.get("slack_used", 0.0) for x in r), default=0.0),
                   "steps_checked": sum(x.get("checked", 0) for x in r),
                   "skipped_steps": sum(x.get("skipped", 0) for x in r),
                   "runs_naming_a_blind_step_or_spike": sum(x.get("named", False) for x in r),
                   "reasons": Counter(x["why"] for x in r if x["rejected"]).most_common(3)} for name, r in per.items()}
    report({"runs": sum(len(r) for r in per.values()),
            "false_rejections": sum(row["false_rejections"] for row in rows.values()),
            "worst_move_of_bound": max(row["worst_move_of_bound"] for row in rows.values()),
            "most_rounding_slack_used": max(row["most_rounding_slack_used"] for row in rows.values()),
            "runs_naming_a_blind_step_or_spike": sum(row["runs_naming_a_blind_step_or_spike"] for row in rows.values()),
            "wall_s": time.perf_counter() - started, "recipes": rows}, args.json)


if __name__ == "__main__":
    main()
