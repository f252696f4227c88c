"""Online challenges against the after-the-fact cheap audit, in one run, for 99% against 5% bad steps.

Trains the tinygpt run of ``bench/verifier_cost.py`` (N steps, the whole state committed at every
step) in three modes, repeated and interleaved (plain, beacon, witnessed, plain, beacon, witnessed,
…) so that the machine's drift hits them alike, and reports medians:

* **plain**: the recorder alone;
* **beacon**: ``witness beacon serve`` (a process of its own) stamping a head every ``--every``
  steps, each step selected with the p that reaches 99 % against 5 % bad steps, every step's move
  checked at 4 parameter chunks (each state's chunk tree hashed, each window's openings written);
* **unchunked**: the same beacon run committing no chunks (``OnlineSpec.chunks = 0``): online
  challenges as they were before every step was checked, to measure what the chunks add;
* **witnessed**: two witnesses (``witness beacon serve`` processes, speaking tlog-witness
  add-checkpoint) cosigning each head as a C2SP checkpoint, each window's randomness a round of a
  local drand endpoint (``witness drand serve``, a third process) with a ``--period`` s period.

For each mode: the wall time and its ratio to the plain run's; the trainer process's own CPU time
(every thread of it: training, the ring's copies, the sending, settling and writing threads) and
the server processes' CPU time over the same run; the ring's peak, the copies, the waits training
made for a full ring, the bytes written; the client threads' CPU (the sending thread, the request
threads, the settling thread) and the time building each head's request on the training thread.
The after-the-fact figures are ``witness respond`` answering q = 90 challenges on a plain run; the
verifier's replay is ``verify --mode online`` of the first beacon run (and of the first witnessed
run, with its witnesses and chain pinned): the later runs of the same recipe are, rightly, counted
by the servers as other attempts of it, which lowers their bound.

The chunks' cost is reported as the trainer's extra compute (the chunk trees' CPU and the openings'
writes, against the plain run's wall time), the bytes of the bundle against the unchunked one's, and
the verifier's extra time (the openings' check and holding each loaded state to its root) against
the plain run's training time.

    python bench/online_cost.py [--steps 10000] [--repeat 2] [--modes plain,beacon,unchunked,witnessed] [--json out.json]
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.beacon.client import BeaconClient
from witness.beacon.drand import DrandClient
from witness.beacon.windows import WitnessedLink
from witness.beacon.witness_client import WitnessClient
from witness.bundle.state import state_tensors
from witness.commit.drand import chain_info
from witness.commit.signing import generate_key
from witness.record import Commitments, Online, Recorder, SelfChecking
from witness.record.online import OnlineSpec
from witness.task import build_task
from witness.verify import Policy, Trust, Verifier
from witness.verify.challenges import challenges_needed
from witness.verify.respond import respond

CONFIG = {"n_layer": 1, "d_model": 64, "n_head": 4, "batch_size": 8, "block": 32, "probes": 2, "probe_len": 8}
MODES = ("plain", "beacon", "unchunked", "witnessed")

try:
    import psutil
except ImportError:  # pragma: no cover - /proc instead
    psutil = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads, not its children)."""
    if psutil is not None:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def self_cpu() -> float:
    """This process's CPU seconds, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _listening_url(proc: subprocess.Popen, port: int) -> str:
    """The URL a server started with ``--port port`` listens on (port 0: the one psutil sees it bound to)."""
    deadline = time.monotonic() + 60
    while port == 0:
        ports = [c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
        if ports:
            port = ports[0]
        elif time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the server never listened")
        else:
            time.sleep(0.1)
    return f"http://127.0.0.1:{port}"


def start_beacon(folder: Path, name: str) -> tuple[subprocess.Popen, str, str]:
    """``witness beacon serve`` on loopback, in its own process: (process, URL, beacon public key).
    It is a tlog-witness too (``--name``). It prints its key, not the port ``--port 0`` got (its
    "serving on" line says port 0): that port is read off the process's listening socket."""
    port = 0 if psutil is not None else _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "beacon", "serve", "--port", str(port), "--db",
                             f"sqlite:///{folder / f'{name}.db'}", "--key", str(folder / f"{name}.pem"),
                             "--name", f"bench.witness/{name}", "--per-minute", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    key = proc.stdout.readline().split()[3]
    url = _listening_url(proc, port)
    deadline = time.monotonic() + 60
    while True:
        try:
            BeaconClient(url, key, retries=1)
            return proc, url, key
        except Exception:  # noqa: BLE001 - not listening yet
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def start_drand(folder: Path, period: int) -> tuple[subprocess.Popen, str, Path]:
    """``witness drand serve --port 0`` in its own process: (process, the URL it prints, its chain info file)."""
    info = folder / "drand-chain.json"
    proc = subprocess.Popen([sys.executable, "-m", "witness.cli", "drand", "serve", "--port", "0", "--period",
                             str(period), "--info-out", str(info)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    m = re.search(r" at (http://\S+)", line)
    if not m:
        raise RuntimeError(f"witness drand serve printed {line!r}")
    return proc, m.group(1), info


def _bytes(folder: Path) -> int:
    """The bytes of every file a bundle holds."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def train(task, out: Path, checkpoint_every: int, beacon=None, spec=None, servers=()) -> dict:
    """One training run: its wall time, the trainer's and the servers' CPU over it, its recorder."""
    before = [process_cpu(p.pid) for p in servers]
    cpu, start = self_cpu(), time.perf_counter()
    rec = Recorder.create(task, out, generate_key(), r=b"\x02" * 32,
                          commit=Commitments(checkpoint_every=checkpoint_every),
                          online=Online(beacon=beacon, spec=spec), self_check=SelfChecking(enabled=False))
    rec.train(progress=False)
    wall, cpu = time.perf_counter() - start, self_cpu() - cpu
    server_cpu = sum(process_cpu(p.pid) for p in servers) - sum(before)
    return {"wall_s": wall, "trainer_cpu_s": cpu, "server_cpu_s": server_cpu, "rec": rec}


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--checkpoint-every", type=int, default=500)
    ap.add_argument("--every", type=int, default=10, help="steps between heads streamed to the beacon")
    ap.add_argument("--witnessed-every", type=int, default=None,
                    help="steps between checkpoints sent to the witnesses (default: OnlineSpec.for_steps's for a "
                         "witnessed run)")
    ap.add_argument("--ring", type=int, default=None, help="the witnessed run's ring (default: OnlineSpec's)")
    ap.add_argument("--period", type=int, default=3, help="the local drand chain's period, seconds")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the interleaved modes")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=CONFIG["batch_size"],
                    help="sequences a step (the copy costs the same; the step grows with it)")
    ap.add_argument("--skip-respond", action="store_true", help="leave out the after-the-fact answer")
    ap.add_argument("--skip-verify", action="store_true", help="leave out verify --mode online")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]  # witnessed@N: a witnessed run with a head every N steps
    if not {m.split("@")[0] for m in modes} <= set(MODES) or "plain" not in modes:
        ap.error(f"--modes: plain and any of {', '.join(MODES[1:])} (witnessed@N: every N steps)")
    torch.set_num_threads(args.threads)
    q = challenges_needed(0.99, 0.05)
    task = build_task("tinygpt", dict(CONFIG, steps=args.steps, batch_size=args.batch_size))
    _ = task.dataset().root  # the data commitment, outside the timed loops
    beacon_spec = OnlineSpec.for_steps(args.steps, every=args.every)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    servers: list[subprocess.Popen] = []
    witnessed_spec = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            if "beacon" in modes or "unchunked" in modes:
                bproc, burl, bkey = start_beacon(tmp, "beacon")
                servers.append(bproc)
            if any(m.startswith("witnessed") for m in modes):
                wits = [start_beacon(tmp, f"w{i}") for i in (1, 2)]
                dproc, durl, dinfo = start_drand(tmp, args.period)
                servers += [w[0] for w in wits] + [dproc]
                chain = chain_info(str(dinfo))
                spec_kw = {"every": args.witnessed_every} if args.witnessed_every else {}
                witnessed_spec = OnlineSpec.for_steps(args.steps, drand=chain.hash.hex(), ring=args.ring, **spec_kw)
                specs = {m: OnlineSpec.for_steps(args.steps, drand=chain.hash.hex(), ring=args.ring,
                                                 every=int(m.split("@")[1])) if "@" in m else witnessed_spec
                         for m in modes if m.startswith("witnessed")}
            for r in range(args.repeat):
                for mode in modes:
                    out = tmp / f"{mode}-{r}"
                    if mode == "plain":
                        run = train(task, out, args.checkpoint_every, servers=servers)
                    elif mode in ("beacon", "unchunked"):
                        spec = beacon_spec if mode == "beacon" else dataclasses.replace(beacon_spec, chunks=0)
                        run = train(task, out, args.checkpoint_every, BeaconClient(burl, bkey), spec, servers=servers)
                    else:
                        link = WitnessedLink([WitnessClient(w[1]) for w in wits], DrandClient(durl, chain))
                        run = train(task, out, args.checkpoint_every, link, specs[mode], servers=servers)
                    run["out"] = out
                    runs[mode].append(run)
                    print(f"{mode} #{r}: {run['wall_s']:.1f} s, trainer CPU {run['trainer_cpu_s']:.1f} s, servers' "
                          f"CPU {run['server_cpu_s']:.1f} s", file=sys.stderr, flush=True)
        finally:
            for p in servers:
                p.terminate()
            for p in servers:
                p.wait(30)
        rec = runs["plain"][-1]["rec"]
        state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(rec.model, rec.optimizer).values())
        respond_s = float("nan")
        if not args.skip_respond:
            start = time.perf_counter()
            respond(runs["plain"][-1]["out"], tmp / "resp", nonce=b"bench", challenges=q)
            respond_s = time.perf_counter() - start
        verified = {}
        for mode in ("beacon", "unchunked"):
            if args.skip_verify or mode not in modes:
                continue
            start = time.perf_counter()
            v = Verifier(Trust(beacon_key=bkey), Policy(mode="online")).verify(runs[mode][0]["out"])
            verified[mode] = {"verify_online_s": time.perf_counter() - start, "accepted": v.accepted,
                              "replayed_steps": v.replayed_steps, "compute_fraction": v.cost_fraction,
                              "detection_probability": v.detection_probability}
            if v.moves is not None:  # the chunks' share of the verifier's time
                verified[mode] |= {"moves_check_s": v.moves["seconds"], "root_check_s": v.moves["root_check_seconds"],
                                   "moves_checked_steps": v.moves["checked"], "moves_worst": v.moves["worst"],
                                   "moves_slack_used": v.moves["slack_used"]}
        sizes = {mode: statistics.median(_bytes(r["out"]) for r in rs) for mode, rs in runs.items()}
        logs = {mode: statistics.median((r["out"] / "log.jsonl").stat().st_size for r in rs) for mode, rs in runs.items()}
        if not args.skip_verify and "witnessed" in modes:
            from witness.verify.online import WitnessTrust

            link = runs["witnessed"][0]["rec"].online.link
            start = time.perf_counter()
            v = Verifier(Trust(witnesses=WitnessTrust(tuple(link.keys), len(link.keys), chain)), Policy(mode="online")).verify(runs["witnessed"][0]["out"])
            verified["witnessed"] = {"verify_online_s": time.perf_counter() - start, "accepted": v.accepted,
                                     "replayed_steps": v.replayed_steps, "compute_fraction": v.cost_fraction,
                                     "detection_probability": v.detection_probability}
    plain_wall = statistics.median(r["wall_s"] for r in runs["plain"])
    plain_cpu = statistics.median(r["trainer_cpu_s"] for r in runs["plain"])
    figures: dict = {"steps": args.steps, "threads": args.threads, "batch_size": args.batch_size,
                     "repeat": args.repeat, "cores": os.cpu_count(), "q_after_the_fact": q,
                     "respond_s": respond_s, "respond_fraction": respond_s / plain_wall, "state_bytes": state_bytes}
    last: dict[str, dict] = {}
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "trainer_cpu_s", "server_cpu_s")}
        m = {"walls_s": [round(r["wall_s"], 2) for r in rs], **med,
             "wall_ratio": med["wall_s"] / plain_wall, "trainer_cpu_ratio": med["trainer_cpu_s"] / plain_cpu}
        m["bundle_bytes"], m["log_bytes"] = sizes[mode], logs[mode]
        if mode != "plain":
            spec = beacon_spec if mode == "beacon" else dataclasses.replace(beacon_spec, chunks=0) \
                if mode == "unchunked" else specs[mode]
            reps = [r["rec"].online.report() for r in rs]
            m["spec"] = spec.to_json()
            last[mode] = reps[0]  # the run verified below (the first of its recipe
            # at the servers: the later ones are priced in as its other attempts, which lowers their bound)
            for k in reps[0]:
                m[k] = statistics.median(x[k] for x in reps)
            # the recorder's own time on the training thread (copies, hashes, records) and the writes' CPU: where
            # the chunks open into the state hash, their tree is the state's hash, which the unchunked run takes too
            m["record_s"] = statistics.median(r["rec"].record_seconds for r in rs)
            m["client_cpu_s"] = statistics.median(x["post_cpu_seconds"] + x["settle_cpu_seconds"]
                                                  + x["request_cpu_seconds"] for x in reps)
            # copies + the chunk trees' CPU + the writes' own CPU (the openings' among them)
            m["online_compute_s"] = m["copy_seconds"] + m["tree_cpu_seconds"] + m["write_cpu_seconds"]
            m["online_compute_fraction"] = m["online_compute_s"] / plain_wall
            m["chunk_tree_fraction"] = m["tree_cpu_seconds"] / plain_wall
            m["peak_ring_bytes"] = m["peak_ring"] * state_bytes
            if mode.startswith("witnessed"):
                m["late_windows"] = statistics.median(r["rec"].online.link.late_windows for r in rs)
            if mode in verified:
                m["verify"] = verified[mode]
        figures[mode] = m
    if "beacon" in figures and "unchunked" in figures:  # what every step's check adds, in one run
        b, u = figures["beacon"], figures["unchunked"]
        figures["chunks"] = {
            "extra_trainer_compute_pp": 100 * (b["online_compute_fraction"] - u["online_compute_fraction"]),
            # the every-step check's whole cost to the trainer: its recorder's time and its writes' CPU against the
            # unchunked run's (which hashes every state too), as a share of the plain run's training
            "extra_trainer_cost_pp": 100 * ((b["record_s"] + b["write_cpu_seconds"]) - (u["record_s"]
                                                                                        + u["write_cpu_seconds"])) / plain_wall,
            "tree": b["spec"].get("tree"),
            "chunk_tree_fraction": b["chunk_tree_fraction"], "trees": b["trees"],
            "tree_ms_per_step": 1000 * b["tree_cpu_seconds"] / max(1, b["trees"]),
            "openings_bytes": b["opened_bytes"], "openings_bytes_per_step": b["opened_bytes"] / args.steps,
            # what the chunks add to a bundle: the openings and the records' roots (the runs' logs differ by those
            # alone), against the unchunked bundle (whose kept states, drawn at random, vary by +-10 % a run)
            "extra_bytes": b["opened_bytes"] + b["log_bytes"] - u["log_bytes"],
            "extra_bytes_ratio": (b["opened_bytes"] + b["log_bytes"] - u["log_bytes"]) / u["bundle_bytes"],
            "bundle_bytes_ratio": b["bundle_bytes"] / u["bundle_bytes"],
            "wall_ratio_chunked_to_unchunked": b["wall_s"] / u["wall_s"]}
        if "verify" in b:
            extra = b["verify"]["moves_check_s"] + b["verify"]["root_check_s"]
            figures["chunks"] |= {"verifier_extra_s": extra, "verifier_extra_fraction": extra / plain_wall,
                                  "verify_moves_check_s": b["verify"]["moves_check_s"],
                                  "verify_root_check_s": b["verify"]["root_check_s"]}
    if "beacon" in figures:  # the beacon run's figures at the top too, as this benchmark reported them before
        b, lb = figures["beacon"], last["beacon"]  # counts of the verified (first) run, medians of times
        figures.update({"p": b["spec"]["p"], "every": b["spec"]["every"], "ring": b["spec"]["ring"],
                        "train_s": plain_wall, "train_with_beacon_s": b["wall_s"],
                        "step_time_overhead": b["wall_ratio"] - 1, "statements": lb["statements"],
                        "selected_steps": lb["selected"], "states_written": lb["written"],
                        "peak_ring_states": lb["peak_ring"], "bytes_written": lb["bytes_written"]})
        if "verify" in b:
            figures.update({"verify_online_s": b["verify"]["verify_online_s"],
                            "verify_online_replayed_steps": b["verify"]["replayed_steps"],
                            "verify_online_compute_fraction": b["verify"]["compute_fraction"],
                            "detection_probability": b["verify"]["detection_probability"]})
    return report(figures, args.json)


if __name__ == "__main__":
    main()
