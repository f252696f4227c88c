"""Honest online runs under torchrun in a loop: for DDP and FSDP2 at 2 and 4 ranks (gloo, CPU), N runs
each with a fresh key and a fresh random seed, online with a local beacon; each run is audited
online (its selected steps replayed from the ranks' shares) and offline with every step replayed.
Counts the rejections, which must be 0. Not part of the suite (minutes); run it in the background:

    .venv/bin/python scripts/dist_honest_loop.py 20 [--ranks 2 4] [--parallelism ddp fsdp]

A failed run's bundle and output are kept under dist-honest-failures/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "tests" / "dist_worker.py"


def free_port() -> int:
    """A port free now (a race with another process is retried by the caller's next run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--parallelism", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--keep", default="dist-honest-failures")
    args = ap.parse_args()

    from witness.beacon.app import create_app
    from witness.commit.signing import generate_key, public_hex, save_key
    from witness.verify import Policy, Trust, Verifier
    from witness.web import start_uvicorn, stop_uvicorn

    tmp = Path(tempfile.mkdtemp(prefix="dist-honest-"))
    bkey = generate_key()
    server, thread, url = start_uvicorn(create_app(f"sqlite:///{tmp / 'beacon.db'}", bkey))
    trust = Trust(beacon_key=public_hex(bkey.public_key()))
    counts: dict[str, list[int]] = {}
    try:
        for ranks in args.ranks:
            for par in args.parallelism:
                name = f"{par}x{ranks}"
                failed = 0
                for i in range(args.n):
                    run = tmp / f"{name}-{i}"
                    key = tmp / f"{name}-{i}.pem"
                    save_key(generate_key(), key)
                    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(WORKER), "--parallelism",
                           par, "--out", str(run), "--key", str(key), "--beacon", url, "--seed-hex",
                           os.urandom(32).hex()]
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    why = None
                    if res.returncode:
                        why = f"training failed:\n{res.stderr[-3000:]}"
                    else:
                        try:
                            on = Verifier(trust, Policy(mode="online")).verify(run)
                            off = Verifier(policy=Policy(challenges=100)).verify(run)
                            if not (on.accepted and off.accepted and off.replayed_steps == 12):
                                why = f"online {on.accepted}, offline {off.accepted} ({off.replayed_steps} steps)"
                        except Exception as e:  # noqa: BLE001 - a rejection is what this loop counts
                            why = f"{type(e).__name__}: {e}"
                    if why is not None:
                        failed += 1
                        dest = Path(args.keep) / f"{name}-{i}"
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        if run.exists():
                            shutil.copytree(run, dest, dirs_exist_ok=True)
                        (Path(args.keep) / f"{name}-{i}.txt").write_text(why)
                    shutil.rmtree(run, ignore_errors=True)
                counts[name] = [args.n, failed]
                print(f"{name}: {args.n} honest online runs, {failed} rejected", flush=True)
    finally:
        stop_uvicorn(server, thread)
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if any(f for _, f in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
