"""GPU benchmark: real witnessed runs of tinygpt at the method's scale, under FSDP2, and their replay.

One command on a machine with one NVIDIA GPU measures everything the issue asks for:

    torchrun --nproc_per_node=1 bench/gpu_witnessed.py --json gpu_witnessed.json

For each preset (``gpt2-small``: 86 M parameters; ``1b``: 1.2 B, with activation checkpointing;
bf16 autocast over fp32 master weights; 64 x 1,024 = 65,536 tokens per step) it

1. trains plain steps (the same FSDP2 model and step, no recorder) and witnessed steps (a
   ``DistRecorder`` writing a real bundle; the state is committed at every step, each rank
   hashing the rows it holds off the training stream), and reports the median step of each, their ratio, the
   recorder's parts (loss all-gather, fingerprint, sketch, state, record) and the peak memory;
2. replays the witnessed run on the same GPU (``Verifier(policy=Policy(device="cuda"))``) with every step
   challenged: whether it is bit-exact, the time of a replayed step and of loading a state, and
   from them the cost of the 99 %/5 % audit (q = 90 one-step challenges) against the training;
3. trains a short run of the ``gpt2-small`` shape (a few windows a step, a checkpoint after every
   step) and replays it on the CPU in tolerance mode: the honest drift per replayed one-step
   segment, against the default thresholds.

It names the GPU, driver, CUDA, cuDNN and torch release it ran on. The figures are written after
every phase, so a run cut short keeps what it measured; a phase that fails is recorded with its
error and the others go on (a preset that runs out of memory is tried again with activation
checkpointing). A smoke test on the CPU (gloo, a small model; the same code paths):

    torchrun --nproc_per_node=1 bench/gpu_witnessed.py --device cpu --small
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from common import parser, report

from witness.commit.signing import generate_key
from witness.distributed.recorder import DistRecorder
from witness.distributed.session import DistSession
from witness.record import Commitments
from witness.session import device_info
from witness.task import build_task
from witness.task.tinygpt import PRESETS
from witness.verify import Policy, Verifier
from witness.verify.challenges import challenges_needed
from witness.verify.replay import Replayer

SMALL = {"n_layer": 2, "n_head": 4, "d_model": 64, "block": 128, "batch_size": 8, "dropout": 0.0,
         "precision": "bf16", "corpus_max_bytes": 300000}
START = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr, with the seconds since the start."""
    print(f"[{time.perf_counter() - START:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    """Wait for the training stream (not the side stream that copies the state off it)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def release(device: torch.device) -> None:
    """Give the memory of what was deleted back, and start the next peak afresh."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """The most memory the device held since the last ``release``."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def timed(obj: object, names: dict[str, str], times: dict[str, list[float]], device: torch.device) -> None:
    """Wrap ``obj``'s methods (method name: figure name) to add each call's time, the training
    stream synchronised, to ``times``."""
    for name, figure in names.items():
        inner = getattr(obj, name)

        def wrapped(*a, _inner=inner, _name=figure, **k):
            sync(device)
            t0 = time.perf_counter()
            out = _inner(*a, **k)
            sync(device)
            times.setdefault(_name, []).append(time.perf_counter() - t0)
            return out

        setattr(obj, name, wrapped)


def median_after(values: list[float], warm: int) -> float:
    """The median once the first steps (allocation, kernel selection, pinning) are past."""
    return statistics.median(values[warm:] or values)


def plain_steps(task, device: torch.device, steps: int) -> list[float]:
    """The same FSDP2 model and step with no recorder: the step times."""
    plain = DistSession(task, b"\x06" * 32, len(task.dataset()), "fsdp")
    ds = task.dataset()
    times = []
    for t in range(steps):
        batch = task.collate([ds.sample_bytes(i) for i in plain.my_share(plain.batch_indices(t))])
        sync(device)
        t0 = time.perf_counter()
        plain.global_output(plain.local_step(t, batch))
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def witnessed_steps(task, device: torch.device, steps: int, out: Path, checkpoint_every: int) -> dict:
    """A witnessed FSDP2 run: step times, the recorder's parts, and the final checkpoint's time."""
    # Every step's state is committed: each rank hashes the rows it holds, off the training stream.
    rec = DistRecorder(task, out, generate_key() if dist.get_rank() == 0 else None, r=b"\x05" * 32,
                       commit=Commitments(checkpoint_every=checkpoint_every), parallelism="fsdp")
    parts: dict[str, list[float]] = {}
    timed(rec.session, {"global_output": "loss all-gather", "fingerprint": "fingerprint", "sketch": "sketch",
                        "full_state": "state"}, parts, device)
    if rec.inner is not None:  # rank 0: the record (the previous state's hash collected, the log line)
        timed(rec.inner, {"log_step": "record"}, parts, device)
    times = []
    for t in range(steps):
        batch = rec.batch(t)
        sync(device)
        t0 = time.perf_counter()
        rec.log_step(t, rec.train_step(t, batch))
        sync(device)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    rec.finish()
    return {"times": times, "parts": parts, "finish_s": time.perf_counter() - t0,
            "state_every": rec.state_every, "overlap": rec.inner.overlap if rec.inner else None}


def replay(out: Path, device: torch.device, steps: int, training_step_s: float) -> dict:
    """Rank 0 replays every step on the training's own hardware; the audit's cost follows from it."""
    parts: dict[str, list[float]] = {}
    originals = {n: getattr(Replayer, n) for n in ("advance", "load")}
    for name, inner in originals.items():
        def wrapped(self, *a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _inner(self, *a, **k)
            finally:
                sync(device)
                parts.setdefault(_name, []).append(time.perf_counter() - t0)

        setattr(Replayer, name, wrapped)
    try:
        t0 = time.perf_counter()
        v = Verifier(policy=Policy(challenges=steps, device=device.type)).verify(out)
        total = time.perf_counter() - t0
    finally:
        for name, inner in originals.items():
            setattr(Replayer, name, inner)
    step_s, load_s = median_after(parts.get("advance", [0.0]), 1), statistics.median(parts.get("load", [0.0]))
    q = challenges_needed(0.99, 0.05)
    # The cheap audit: q challenges, each loading a committed state and replaying one step.
    audit_s = q * (load_s + step_s)
    return {"replay_exact": v.accepted and v.exact, "verdict": "accepted" if v.accepted else v.failures[:3],
            "replayed_steps": v.replayed_steps, "verify_s": total, "replay_step_s": step_s,
            "replay_vs_training_step": step_s / training_step_s, "state_load_s": load_s,
            "audit_99_5": {"challenges": q, "seconds": audit_s,
                           "fraction_of_training": {n: audit_s / (n * training_step_s) for n in (1_000, 10_000, 100_000)}}}


def bench_preset(name: str, config: dict, device: torch.device, steps: int, tmp: Path) -> dict:
    """Plain and witnessed steps of one model, then its replay."""
    task = build_task("tinygpt", dict(config, steps=steps))
    figures: dict = {"preset": name, "parameters": task.parameter_count(),
                     "tokens_per_step": task.config.batch_size * task.config.block,
                     "activation_checkpointing": task.config.activation_checkpointing}
    warm = min(3, steps // 3)
    log(f"{name}: plain steps")
    plain = plain_steps(task, device, steps)
    figures["peak_gib_plain"] = peak_gib(device)
    release(device)
    log(f"{name}: witnessed steps")
    out = tmp / name
    w = witnessed_steps(task, device, steps, out, checkpoint_every=steps)
    figures["peak_gib_witnessed"] = peak_gib(device)
    release(device)
    p = median_after(plain, warm)
    ws = median_after(w["times"][:-1], warm)  # the last step also writes the checkpoint
    figures |= {"plain_step_s": p, "witnessed_step_s": ws, "overhead": ws / p - 1,
                "plain_steps_s": plain, "witnessed_steps_s": w["times"],
                "state_every": w["state_every"], "state_hash_off_stream": w["overlap"],
                "parts_s": {k: median_after(v[:-1], warm) for k, v in w["parts"].items()},
                "parts_sum_vs_plain_step": sum(median_after(v[:-1], warm) for k, v in w["parts"].items()) / p,
                "last_step_with_checkpoint_s": w["times"][-1], "finish_s": w["finish_s"]}
    if dist.get_rank() == 0:
        log(f"{name}: replay on {device.type}")
        figures["replay"] = replay(out, device, steps, ws)
        release(device)
    return figures


def drift(config: dict, device: torch.device, steps: int, tmp: Path) -> dict:
    """A short GPU run with a checkpoint after every step, replayed on the CPU in tolerance mode."""
    task = build_task("tinygpt", dict(config, steps=steps, batch_size=4 * dist.get_world_size()))
    out = tmp / "drift"
    witnessed_steps(task, device, steps, out, checkpoint_every=1)
    release(device)
    if dist.get_rank() != 0:
        return {}
    t0 = time.perf_counter()
    tol = Verifier(policy=Policy(challenges=steps, exact=False, device="cpu")).verify(out)
    worst: dict[str, float] = {}
    for res in tol.results:
        for k, d in res.distances.items():
            worst[k] = max(worst.get(k, 0.0), d)
    return {"shape": {k: task.config_json()[k] for k in ("n_layer", "d_model", "block", "batch_size", "precision")},
            "segments": [r.distances for r in tol.results], "max_distance": worst,
            "thresholds": tol.thresholds, "accepted": tol.accepted, "cpu_replay_s": time.perf_counter() - t0}


def attempt(figures: dict, key: str, fn, device: torch.device, save) -> dict | None:
    """Run one phase; record its figures, or its error, and write everything measured so far."""
    try:
        result = fn()
    except Exception as e:  # recorded, and the next phase still runs
        result = {"error": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc(limit=-6)[-4000:]}
        if isinstance(e, torch.OutOfMemoryError):
            result["out_of_memory"] = True
        del e
    release(device)
    figures.setdefault(key, []).append(result)
    save()
    log(f"{key}: {'error: ' + result['error'] if 'error' in result else 'done'}")
    return result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a small model (the CPU smoke test)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--presets", default="gpt2-small,1b")
    ap.add_argument("--drift-steps", type=int, default=3, help="one-step segments replayed on the CPU (0: none)")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{dist.get_rank()}" if args.device == "cuda" else "cpu")
    configs = {"small": SMALL} if args.small else {n: PRESETS[n] for n in args.presets.split(",")}
    figures: dict = {"hardware": device_info(device), "torch": torch.__version__,
                     "ranks": dist.get_world_size(), "steps": args.steps}

    def save() -> None:
        if dist.get_rank() == 0 and args.json:
            report(figures, args.json)

    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            with tempfile.TemporaryDirectory(dir=tmp) as sub:  # a preset's checkpoints go with it
                r = attempt(figures, "runs", lambda n=name, c=config, d=sub: bench_preset(n, c, device, args.steps, Path(d)),
                            device, save)
            if r and r.get("out_of_memory") and not config.get("activation_checkpointing"):
                log(f"{name}: out of memory; again with activation checkpointing")
                with tempfile.TemporaryDirectory(dir=tmp) as sub:
                    attempt(figures, "runs", lambda n=name, c=dict(config, activation_checkpointing=True), d=sub:
                            bench_preset(n + "+recompute", c, device, args.steps, Path(d)), device, save)
        if args.drift_steps:
            shape = SMALL if args.small else PRESETS["gpt2-small"]
            attempt(figures, "drift", lambda: drift(shape, device, args.drift_steps, Path(tmp)), device, save)
    if dist.get_rank() == 0:
        report(figures, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
