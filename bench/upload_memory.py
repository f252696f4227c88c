"""Leaderboard: the server's peak memory while it takes a multi-GB upload (target: under 300 MB above rest).

A real server (``witness leaderboard serve``, SQLite, one worker) takes a submission whose bundle
holds one file of ``--gb`` gigabytes; the archive is streamed from disk by the client. The server
streams it to its store, unpacks it with its own code and opens the bundle (which it refuses: the
bundle holds nothing else, so the run stops there, after every byte went through the server). The
figure is the server process's peak resident memory (Linux ``VmHWM``) above its peak at rest, and
the throughput.
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
from witness.leaderboard.s3store import S3Store
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


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gb", type=float, default=2.0, help="size of the bundle's one file, in GB")
    ap.add_argument("--s3", metavar="URL", help="also time an s3://bucket/prefix store putting and fetching the same "
                                              "archive, in a process of its own (endpoint and credentials from the "
                                              "environment)")
    args = ap.parse_args()
    size = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "witness.cli", "leaderboard", "serve", "--store", str(tmp / "store"),
               "--port", str(port), "--max-upload", str(2 * size), "--track", "quick=tiny:steps=20@accuracy+"]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    httpx.get(f"{url}/api/tracks", timeout=2)
                    break
                except httpx.TransportError:
                    time.sleep(0.2)
            with httpx.Client(base_url=url, timeout=600) as c:
                token = C.register(c, "big", public_hex(generate_key().public_key()))["token"]
                for _ in range(20):  # warm: the pages and API a server has served before the upload
                    c.get("/api/tracks")
                rest = peak_rss_mb(server.pid)
                big = tmp / "big.bin"
                with open(big, "wb") as f:  # a sparse file: the bytes are zeros, written by tar
                    f.truncate(size)
                archive = tmp / "submission.tar"
                with tarfile.open(archive, "w") as tf:
                    tf.add(big, arcname="bundle/checkpoints/00000001.safetensors")
                big.unlink()

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
            figures = {"upload_bytes": archive.stat().st_size, "status": r.status_code, "answer": r.json()["detail"][:120],
                    "server_rest_peak_mb": round(rest, 1), "server_upload_peak_mb": round(peak, 1),
                    "above_rest_mb": round(peak - rest, 1), "target_mb": 300, "seconds": round(seconds, 1),
                    "mb_per_s": round(archive.stat().st_size / 1e6 / seconds, 1)}
            if args.s3:
                figures["s3"] = s3_put_and_fetch(args.s3, archive, tmp)
            report(figures, args.json)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)


if __name__ == "__main__":
    main()
