"""GPU benchmark: real witnessed runs of tinygpt at the method's scale, under FSDP2, and their replay.

One command on a machine with one NVIDIA GPU measures everything the issue asks for:

    torchrun --nproc_per_node=1 bench/gpu_witnessed.py --json gpu_witnessed.json

For each preset (``gpt2-small``: 86 M parameters; ``1b``: 1.2 B; bf16 autocast over fp32
master weights; 64 x 1,024 = 65,536 tokens per step) it

1. trains plain steps (the same FSDP2 model and step, no recorder) and witnessed steps (a
   ``DistRecorder`` writing a real bundle), and reports the median step of each, their ratio,
   and the recorder's parts (loss all-gather, fingerprint, sketch, state gather and hash, record);
2. replays the witnessed run on the same GPU (``verify_bundle(device="cuda")``) with every
   step challenged: whether it is bit-exact, and its cost as a fraction of the training time;
3. for ``gpt2-small``, replays it on the CPU in tolerance mode: the honest drift per replayed
   segment (the distances the thresholds must clear), against the default thresholds.

It names the GPU, driver, CUDA, cuDNN and torch release it ran on. A smoke test on the CPU
(gloo, a small model; the same code paths):

    torchrun --nproc_per_node=1 bench/gpu_witnessed.py --device cpu --small
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parser, report

from witness.commit.signing import generate_key
from witness.distributed.recorder import DistRecorder
from witness.distributed.session import DistSession
from witness.session import device_info
from witness.task import build_task
from witness.task.tinygpt import PRESETS
from witness.verify.audit import verify_bundle

SMALL = {"n_layer": 2, "n_head": 4, "d_model": 64, "block": 128, "batch_size": 8, "dropout": 0.0,
         "precision": "bf16", "corpus_max_bytes": 2_000_000}


def sync(device: torch.device) -> None:
    """Wait for the device (step times are wall-clock times of finished work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_parts(rec: DistRecorder, device: torch.device) -> dict[str, list[float]]:
    """Wrap the recorder's per-step collectives to time each part (synchronised)."""
    parts: dict[str, list[float]] = {}
    s = rec.session
    for name in ("global_output", "fingerprint", "sketch", "full_state"):
        inner = getattr(s, name)

        def wrapped(*a, _inner=inner, _name=name, **k):
            sync(device)
            t0 = time.perf_counter()
            out = _inner(*a, **k)
            sync(device)
            parts.setdefault(_name, []).append(time.perf_counter() - t0)
            return out

        setattr(s, name, wrapped)
    if rec.inner is not None:  # rank 0: the record itself (state hash where committed, log line)
        inner_log = rec.inner.log_step

        def record(*a, **k):
            t0 = time.perf_counter()
            inner_log(*a, **k)
            parts.setdefault("record (state hash, log line)", []).append(time.perf_counter() - t0)

        rec.inner.log_step = record
    return parts


def bench_preset(name: str, config: dict, device: torch.device, steps: int, tmp: Path, drift: bool) -> dict:
    """Plain and witnessed steps of one model, then its replay."""
    task = build_task("tinygpt", dict(config, steps=steps))
    r = b"\x05" * 32
    plain = DistSession(task, b"\x06" * 32, len(task.dataset()), "fsdp")
    ds = task.dataset()
    plain_times = []
    for t in range(steps):
        batch = task.collate([ds.sample_bytes(i) for i in plain.my_share(plain.batch_indices(t))])
        sync(device)
        t0 = time.perf_counter()
        plain.global_output(plain.local_step(t, batch))
        sync(device)
        plain_times.append(time.perf_counter() - t0)
    del plain
    out = tmp / name
    rec = DistRecorder(task, out, generate_key() if dist.get_rank() == 0 else None, r=r,
                       checkpoint_every=steps, state_every=1, parallelism="fsdp")
    parts = timed_parts(rec, device)
    witnessed_times = []
    for t in range(steps):
        batch = rec.batch(t)
        sync(device)
        t0 = time.perf_counter()
        rec.log_step(t, rec.train_step(t, batch))
        sync(device)
        witnessed_times.append(time.perf_counter() - t0)
    rec.finish()
    warm = max(1, steps // 4)  # the first steps pay for allocation and kernel selection
    p, w = statistics.median(plain_times[warm:]), statistics.median(witnessed_times[warm:])
    figures = {"preset": name, "parameters": task.parameter_count(),
               "tokens_per_step": task.config.batch_size * task.config.block,
               "plain_step_s": p, "witnessed_step_s": w, "overhead": w / p - 1,
               "parts_s": {k: statistics.median(v[warm:]) for k, v in parts.items()}}
    if dist.get_rank() == 0:
        t0 = time.perf_counter()
        v = verify_bundle(out, challenges=steps, device=str(device.type))
        replay_s = time.perf_counter() - t0
        figures |= {"replay_exact": v.accepted and v.exact, "replayed_steps": v.replayed_steps,
                    "replay_s": replay_s, "replay_vs_training": replay_s / sum(witnessed_times)}
        if drift and device.type == "cuda":
            tol = verify_bundle(out, challenges=min(steps, 4), exact=False, device="cpu")
            worst: dict[str, float] = {}
            for res in tol.results:
                for k, d in res.distances.items():
                    worst[k] = max(worst.get(k, 0.0), d)
            figures["tolerance_drift_gpu_to_cpu"] = {"max_distance": worst, "thresholds": tol.thresholds,
                                                     "accepted": tol.accepted}
    return figures


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a small model (the CPU smoke test)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--presets", default="gpt2-small,1b")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{dist.get_rank()}" if args.device == "cuda" else "cpu")
    configs = {"small": SMALL} if args.small else {n: PRESETS[n] for n in args.presets.split(",")}
    figures = {"hardware": device_info(device), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            figures["runs"].append(bench_preset(name, config, device, args.steps, Path(tmp), name != "1b"))
    if dist.get_rank() == 0:
        report(figures, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
