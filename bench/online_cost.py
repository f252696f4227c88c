"""Online challenges against the after-the-fact cheap audit, in one run, for 99% against 5% bad steps.

Trains the tinygpt run of ``bench/verifier_cost.py`` (N steps, the whole state committed at every
step) twice: once with the recorder alone, then with a beacon on loopback (``witness beacon
serve`` in a process of its own) selecting each step with the p that reaches 99 % against 5 % bad
steps. Reports, as fractions of the training time measured here:

* the trainer's extra work to answer online (host copies of the ring, timed on the training
  thread, and writing the selected states, in wall time and in the writing thread's CPU time),
  against ``witness respond`` answering q = 90 challenges after training on the beacon-less run;
* the step-time overhead of the run with the beacon against the run without;
* the verifier's replay in ``verify --mode online`` (its compute and time);
* the ring's peak host memory (peak states held x one state's bytes) and the bytes written.

    python bench/online_cost.py [--steps 10000] [--checkpoint-every 500] [--json out.json]
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.beacon.client import BeaconClient
from witness.bundle.state import state_tensors
from witness.commit.signing import generate_key
from witness.record import Recorder
from witness.record.online import OnlineSpec
from witness.task import build_task
from witness.verify import verify_bundle
from witness.verify.challenges import challenges_needed
from witness.verify.respond import respond

CONFIG = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_beacon(folder: Path) -> tuple[subprocess.Popen, str, str]:
    """``witness beacon serve`` on loopback, in its own process: (process, URL, public key)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "beacon", "serve", "--port", str(port), "--db",
                             f"sqlite:///{folder / 'beacon.db'}", "--key", str(folder / "beacon.pem")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    key = proc.stdout.readline().split()[3]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            BeaconClient(url, key, retries=1)
            return proc, url, key
        except Exception:  # noqa: BLE001 - not listening yet
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def train(task, out: Path, checkpoint_every: int, beacon=None, spec=None) -> tuple[float, Recorder]:
    start = time.perf_counter()
    rec = Recorder.create(task, out, generate_key(), r=b"\x02" * 32, checkpoint_every=checkpoint_every,
                          beacon=beacon, online=spec, self_check=False)
    rec.train(progress=False)
    return time.perf_counter() - start, rec


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--every", type=int, default=10, help="steps between heads streamed to the beacon")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=CONFIG["batch_size"],
                    help="sequences a step (the copy costs the same; the step grows with it)")
    ap.add_argument("--skip-respond", action="store_true", help="leave out the after-the-fact answer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q = challenges_needed(0.99, 0.05)
    task = build_task("tinygpt", dict(CONFIG, steps=args.steps, batch_size=args.batch_size))
    _ = task.dataset().root  # the data commitment, outside the timed loops
    spec = OnlineSpec.for_steps(args.steps, every=args.every)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plain_s, _ = train(task, tmp / "plain", args.checkpoint_every)
        respond_s = float("nan")
        if not args.skip_respond:
            start = time.perf_counter()
            respond(tmp / "plain", tmp / "resp", nonce=b"bench", challenges=q)
            respond_s = time.perf_counter() - start

        proc, url, key = start_beacon(tmp)
        try:
            online_s, rec = train(task, tmp / "online", args.checkpoint_every, BeaconClient(url, key), spec)
        finally:
            proc.terminate()
            proc.wait(30)
        r = rec.online.report()
        state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(rec.model, rec.optimizer).values())
        start = time.perf_counter()
        v = verify_bundle(tmp / "online", mode="online", beacon_key=key)
        verify_s = time.perf_counter() - start
    answer_s = r["copy_seconds"] + r["write_seconds"] + r["wait_seconds"]
    # compute: the copies (training thread) and the writes' own CPU time (a background thread;
    # their wait on the disk's fsync is not work)
    compute_s = r["copy_seconds"] + r["write_cpu_seconds"]
    return report({
        "steps": args.steps, "threads": args.threads, "batch_size": args.batch_size, "p": spec.p, "every": spec.every, "ring": spec.ring,
        "train_s": plain_s, "train_with_beacon_s": online_s,
        "step_time_overhead": online_s / plain_s - 1,
        "online_answer_s": answer_s, "online_answer_fraction": answer_s / plain_s,
        "online_compute_s": compute_s, "online_compute_fraction": compute_s / plain_s,
        "online_copy_s": r["copy_seconds"], "online_write_s": r["write_seconds"],
        "online_write_cpu_s": r["write_cpu_seconds"], "online_waits": r["waits"],
        "respond_s": respond_s, "respond_fraction": respond_s / plain_s, "respond_challenges": q,
        "answer_ratio_online_to_respond": answer_s / respond_s,
        "statements": r["statements"], "selected_steps": r["selected"], "states_written": r["written"],
        "bytes_written": r["bytes_written"], "state_bytes": state_bytes, "peak_ring_states": r["peak_ring"],
        "peak_ring_bytes": r["peak_ring"] * state_bytes,
        "verify_online_s": verify_s, "verify_online_time_fraction": verify_s / plain_s,
        "verify_online_replayed_steps": v.replayed_steps, "verify_online_compute_fraction": v.cost_fraction,
        "detection_probability": v.detection_probability,
    }, args.json)


if __name__ == "__main__":
    main()
