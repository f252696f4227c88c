"""A stolen model swapped in, at one step or spread over many, against online audits.

**The single-step swap** (the red team's): a 40-step tinygpt run (the small recipe of
``bench/online_cost.py``), online with a beacon at p = 0.25 and a head every 4 steps. Before step 20
trains, the trainer puts in place the weights of a stolen tinygpt (the same recipe, trained
elsewhere from another seed for ``--stolen-steps`` steps), then trains on honestly. Each trial is a
run of its own (its own r, its own draws), audited online; the bench counts the audits that reject
it, those whose verdict names step 20 and a coordinate, and those where replay alone would have
caught it (the draw selected step 20: p of them, the rate before every step was checked).

**The staged swap**: a trainer that moves every coordinate toward the stolen model by at most what
its step allows (``lr_t * B_t`` after the weight decay, a hair under it) needs s steps to get there;
each is a step that does not replay, selected with probability p. The bench measures s from the
run's state at step 20 (for the 40-step recipe, whose rates fall to a tenth, and at the recipe's
peak rate), and runs staged trials that spend those steps, audited online.

    python bench/swap_detection.py [--trials 50] [--staged-trials 20] [--json out.json]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import parser, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from starlette.testclient import TestClient  # noqa: E402

from witness.beacon.app import create_app  # noqa: E402
from witness.beacon.client import BeaconClient  # noqa: E402
from witness.bundle.layout import LEAVES  # noqa: E402
from witness.commit.beacon import p_needed  # noqa: E402
from witness.commit.signing import generate_key, public_hex  # noqa: E402
from witness.data.order import derive_run_seed  # noqa: E402
from witness.errors import RunRejected  # noqa: E402
from witness.fingerprint.moves import move_rules  # noqa: E402
from witness.record import Commitments, Online, Recorder, SelfChecking  # noqa: E402
from witness.record.online import OnlineSpec  # noqa: E402
from witness.session import TrainingSession  # noqa: E402
from witness.task import build_task  # noqa: E402
from witness.task.base import StepOutput  # noqa: E402
from witness.verify import Evidence, Policy, Trust, Verifier  # noqa: E402

CONFIG = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8}
STEPS, SWAP_AT, P, EVERY = 40, 20, 0.25, 4
MARGIN = 0.999  # a staged step moves a coordinate by at most this much of what its step allows


def stolen_model(task_config: dict, steps: int) -> dict[str, torch.Tensor]:
    """A tinygpt of the same recipe, trained elsewhere: another seed, ``steps`` steps."""
    task = build_task("tinygpt", task_config | {"steps": steps})
    ds = task.dataset()
    session = TrainingSession(task, derive_run_seed(ds.commitment_root(2), b"\x5a" * 32), len(ds))
    for t in range(steps):
        session.step(t, [ds.sample_bytes(i) for i in session.batch_indices(t)])
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


def allowed_moves(rec: Recorder, t: int) -> dict[str, tuple[float, float]]:
    """For each parameter, (the factor its weight decays by at step t, the most step t may move it)."""
    rules = move_rules(rec.model, rec.optimizer)
    assert not isinstance(rules, str), rules
    lr = rec.lr(t)
    out = {}
    for name, rule in rules.rules.items():
        bound = rules.bounds(rule.betas, t + 1)[t] if rule.betas else 0.0
        out[name.removeprefix("model.")] = (1.0 - lr * rule.decay, MARGIN * lr * bound)
    return out


def staged_steps(rec: Recorder, target: dict[str, torch.Tensor], start: int, horizon: int,
                 hold: bool = False) -> tuple[int | None, list]:
    """How many steps from ``start`` a swap to ``target`` takes when no coordinate moves past its
    step's bound, on the recipe's schedule (its last rate after its end; ``hold``: the rate of step
    ``start`` throughout), and the share of coordinates in place after 10, 50, 100 and 500 steps."""
    theta = {n: p.detach().double().clone() for n, p in rec.model.named_parameters()}
    goal = {n: target[n].double() for n in theta}
    total = sum(v.numel() for v in theta.values())
    shares = []
    for k in range(horizon):
        t = start if hold else min(start + k, rec.task.config.steps - 1)
        limits = allowed_moves(rec, t)
        done = 0
        for n in theta:
            decay, most = limits[n]
            base = theta[n] * decay
            theta[n] = base + (goal[n] - base).clamp(-most, most)
            done += int((theta[n] - goal[n]).abs().le(1e-7).sum())
        if k + 1 in (10, 50, 100, 500):
            shares.append((k + 1, done / total))
        if done == total:
            return k + 1, shares
    return None, shares


def out_of_bound(rec: Recorder, target: dict[str, torch.Tensor], t: int, k: int = 4) -> dict:
    """Of the run's parameter chunks, the share a swap to ``target`` at step ``t`` moves past the bound
    somewhere, and the chance that k chunks drawn without replacement miss every one of them."""
    from witness.fingerprint.chunks import ChunkLayout

    layout = ChunkLayout.of_model(rec.model)
    limits = allowed_moves(rec, t)
    moved = {f"model.{n}": (target[n] - p.detach() * limits[n][0]).abs() > limits[n][1] / MARGIN
             for n, p in rec.model.named_parameters()}
    bad = 0
    for c in range(layout.size):
        i, first, count = layout.locate(c)
        bad += bool(moved[layout.tensors[i][0]].reshape(-1)[first:first + count].any())
    miss = math.comb(layout.size - bad, k) / math.comb(layout.size, k)
    coords = torch.cat([m.reshape(-1) for m in moved.values()])
    return {"chunks": layout.size, "out_of_bound": bad, "share": bad / layout.size,
            "coordinates_out_of_bound": float(coords.float().mean()), "missed_by_k_chunks": miss}


class Beacon:
    """A beacon on its own SQLite file, reached in-process."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.key = generate_key()
        self.http = TestClient(create_app(f"sqlite:///{folder / 'beacon.db'}", self.key))
        self.public_key = public_hex(self.key.public_key())


def trial(folder: Path, task, leaves: Path, stolen: dict, staged: int = 0) -> dict:  # noqa: ANN001 - a Task
    """One run with the swap (at one step, or staged over ``staged`` steps), audited online."""
    beacon = Beacon(folder)
    rec = Recorder.create(task, folder / "run", generate_key(), r=os.urandom(32),
                          commit=Commitments(checkpoint_every=STEPS, leaves=False),
                          online=Online(beacon=BeaconClient(beacon.http), spec=OnlineSpec(P, EVERY, 2 * EVERY + 1)),
                          self_check=SelfChecking(enabled=False))
    bad = set()
    for t in range(task.config.steps):
        batch = rec.batch(t)
        if t == SWAP_AT and not staged:
            with torch.no_grad():
                for n, p in rec.model.named_parameters():
                    p.copy_(stolen[n])
            bad.add(t)
        if staged and SWAP_AT <= t < SWAP_AT + staged:  # no training: a step that moves toward the stolen model
            limits = allowed_moves(rec, t)
            with torch.no_grad():
                for n, p in rec.model.named_parameters():
                    decay, most = limits[n]
                    base = p * decay
                    p.copy_(base + (stolen[n] - base).clamp(-most, most))
            rec.log_step(t, StepOutput(2.0, rec.lr(t), 1.0))
            bad.add(t)
            continue
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t)))
    rec.finish()
    try:
        v = Verifier(Trust(beacon_key=beacon.public_key), Policy(mode="online")).verify(folder / "run", Evidence(leaves=leaves))
        return {"rejected": False, "selected_bad": bool(bad & set(v.online["selected"]))}
    except RunRejected as e:
        v = e.verdict
        named = any(f.startswith(f"step {SWAP_AT}: moves: model.") and "moved from" in f for f in e.failures)
        return {"rejected": True, "names_step_and_coordinate": named,
                "by_moves": "failed_window" in (v.moves or {}),
                "selected_bad": bool(bad & set(v.online["selected"])), "first_failure": e.failures[0][:240]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--staged-trials", type=int, default=20)
    ap.add_argument("--stolen-steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    task = build_task("tinygpt", CONFIG | {"steps": STEPS})
    started = time.perf_counter()
    stolen = stolen_model(CONFIG, args.stolen_steps)
    out: dict = {"config": CONFIG | {"steps": STEPS}, "swap_at": SWAP_AT, "p": P, "every": EVERY,
                 "stolen_steps": args.stolen_steps}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ds = task.dataset()
        leaves = tmp / LEAVES
        ds.leaves.write(leaves, ds.commitment_root(2))
        runs = [trial(tmp / f"swap{i}", task, leaves, stolen) for i in range(args.trials)]
        out["single_step"] = {
            "trials": len(runs), "rejected": sum(r["rejected"] for r in runs),
            "verdict_names_step_and_coordinate": sum(r.get("names_step_and_coordinate", False) for r in runs),
            "step_selected_for_replay": sum(r["selected_bad"] for r in runs),
            "example_failure": next((r["first_failure"] for r in runs if r["rejected"]), None)}
        # how far the stolen model is, and how long a swap inside the bound takes
        probe = Recorder.create(task, tmp / "probe", generate_key(), r=os.urandom(32),
                                commit=Commitments(checkpoint_every=STEPS, leaves=False),
                                self_check=SelfChecking(enabled=False))
        for t in range(SWAP_AT):
            probe.log_step(t, task.train_step(probe.model, probe.optimizer, probe.batch(t), probe.lr(t),
                                              probe.step_seed(t)))
        gap = torch.cat([(stolen[n] - p.detach()).abs().reshape(-1) for n, p in probe.model.named_parameters()])
        out["chunks_out_of_bound"] = out_of_bound(probe, stolen, SWAP_AT)
        s_recipe, shares = staged_steps(probe, stolen, SWAP_AT, 20_000)
        peak = staged_steps(probe, stolen, task.config.warmup - 1, 20_000, hold=True)  # the peak rate, held
        out["distance"] = {"max": float(gap.max()), "median": float(gap.median()),
                           "peak_lr_times_B": allowed_moves(probe, task.config.warmup - 1)["tok.weight"][1] / MARGIN}
        out["staged"] = {"steps_needed_on_the_recipe": s_recipe, "in_place_after": shares,
                         "steps_needed_at_peak_rate": peak[0]}
        s = peak[0] if peak[0] is not None else 20_000
        p10k = p_needed(0.99, 0.05, 10_000)
        out["staged"]["detection_at_p"] = {f"{P:g}": 1 - (1 - P) ** s, f"{p10k:.4g}": 1 - (1 - p10k) ** s}
        # staged trials: a run long enough for the staged steps, at the peak rate's s (a lower bound on s)
        if args.staged_trials:
            long = build_task("tinygpt", CONFIG | {"steps": SWAP_AT + min(s, 200) + 4})
            staged = [trial(tmp / f"staged{i}", long, leaves, stolen, staged=min(s, 200))
                      for i in range(args.staged_trials)]
            out["staged"]["trials"] = {"trials": len(staged), "staged_steps": min(s, 200),
                                       "rejected": sum(r["rejected"] for r in staged),
                                       "rejected_by_the_move_check": sum(r.get("by_moves", False) for r in staged),
                                       "expected_at_p": 1 - (1 - P) ** min(s, 200)}
    out["wall_s"] = time.perf_counter() - started
    out["caught_share"] = out["single_step"]["rejected"] / max(1, out["single_step"]["trials"])
    out["caught_lower_95"] = _wilson_lower(out["single_step"]["rejected"], out["single_step"]["trials"])
    report(out, args.json)


def _wilson_lower(k: int, n: int, z: float = 1.96) -> float:
    """The lower end of the 95 % Wilson interval of k successes in n trials."""
    if n == 0:
        return 0.0
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return float(np.clip((centre - spread) / (1 + z * z / n), 0, 1))


if __name__ == "__main__":
    main()
