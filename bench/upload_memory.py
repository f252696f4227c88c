"""Leaderboard: the server's peak memory while it takes a multi-GB upload (target: under 300 MB above rest).

A real server (``witness leaderboard serve``, one worker) takes a submission whose bundle holds one
file of ``--gb`` gigabytes; the archive is streamed from disk by the client. The server streams it
into its store as it arrives, unpacks it with its own code in the same pass and opens the bundle
(which it refuses: the bundle holds nothing else, so the run stops there, after every byte went
through the server). The figure is the server process's peak resident memory (Linux ``VmHWM``) above
its peak at rest, and the throughput: for the local store (SQLite), and with ``--s3`` and ``--db``
for an S3 store (the upload a multipart upload into the bucket while it arrives). ``--s3`` also
times a worker's put and fetch of the same archive, in a process of its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
from common import parser, report

from witness.commit.signing import generate_key, public_hex
from witness.leaderboard import client as C


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size so far, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM (Linux only)")


S3_PROBE = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from upload_memory import peak_rss_mb
from witness.store.s3 import S3Store
import os
store = S3Store({url!r}, Path({work!r}))
rest = peak_rss_mb(os.getpid())
t = time.perf_counter()
store.put("bench/submission.tar", Path({archive!r}))
up = time.perf_counter() - t
t = time.perf_counter()
store.fetch("bench/submission.tar", Path({work!r}) / "back.tar")
down = time.perf_counter() - t
store.delete("bench/submission.tar")
print(json.dumps({{"rest_peak_mb": round(rest, 1), "peak_mb": round(peak_rss_mb(os.getpid()), 1),
                   "put_s": round(up, 1), "fetch_s": round(down, 1)}}))
"""


def s3_put_and_fetch(url: str, archive: Path, tmp: Path) -> dict:
    """The S3 store's multipart put and streamed fetch of the archive, in a process of its own."""
    import json

    code = S3_PROBE.format(bench=str(Path(__file__).parent), url=url, work=str(tmp / "s3work"), archive=str(archive))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["above_rest_mb"] = round(got["peak_mb"] - got["rest_peak_mb"], 1)
    return got


def serve_and_upload(archive: Path, store_args: list[str], env: dict[str, str], max_upload: int) -> dict:
    """A server on ``store_args`` taking ``archive``: its memory above rest, and the throughput."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "witness.cli", "leaderboard", "serve", *store_args, "--port", str(port),
           "--max-upload", str(max_upload), "--track", "quick=tiny:steps=20@accuracy+"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env=os.environ | env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/api/tracks", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=1800) as c:
            token = C.register(c, f"big{port}", public_hex(generate_key().public_key()))["token"]
            for _ in range(20):  # warm: the pages and API a server has served before the upload
                c.get("/api/tracks")
            rest = peak_rss_mb(server.pid)

            def chunks():
                with open(archive, "rb") as f:
                    while chunk := f.read(1 << 20):
                        yield chunk

            started = time.perf_counter()
            r = c.post("/api/submissions", content=chunks(), headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/x-tar",
                "Content-Length": str(archive.stat().st_size)})
            seconds = time.perf_counter() - started
        peak = peak_rss_mb(server.pid)
        return {"status": r.status_code, "answer": r.json()["detail"][:120], "server_rest_peak_mb": round(rest, 1),
                "server_upload_peak_mb": round(peak, 1), "above_rest_mb": round(peak - rest, 1), "target_mb": 300,
                "seconds": round(seconds, 1), "mb_per_s": round(archive.stat().st_size / 1e6 / seconds, 1)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gb", type=float, default=2.0, help="size of the bundle's one file, in GB")
    ap.add_argument("--s3", metavar="URL", help="also an s3://bucket/prefix store (endpoint and credentials from the "
                                              "environment; needs --db)")
    ap.add_argument("--db", metavar="URL", help="the PostgreSQL database of the S3 run")
    args = ap.parse_args()
    if args.s3 and not args.db:
        ap.error("--s3 needs --db postgresql://… (an S3 store is shared through a shared database)")
    size = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = tmp / "big.bin"
        with open(big, "wb") as f:  # a sparse file: the bytes are zeros, written by tar
            f.truncate(size)
        archive = tmp / "submission.tar"
        with tarfile.open(archive, "w") as tf:
            tf.add(big, arcname="bundle/checkpoints/00000001.safetensors")
        big.unlink()
        figures: dict = {"upload_bytes": archive.stat().st_size,
                         "local": serve_and_upload(archive, ["--store", str(tmp / "store")], {}, 2 * size)}
        if args.s3:
            figures["s3_server"] = serve_and_upload(archive, ["--store", args.s3, "--work", str(tmp / "work"),
                                                              "--db", args.db], {}, 2 * size)
            figures["s3_worker"] = s3_put_and_fetch(args.s3, archive, tmp)
        report(figures, args.json)


if __name__ == "__main__":
    main()
