"""The seed's scale on this machine: a ~124 M-parameter GPT under torchrun on 2 CPU ranks (gloo),
FSDP2 and DDP, plain and witnessed online (two local witnesses and a local drand endpoint), then
verified by one process online and offline. Slow (minutes): a benchmark, not a test.

    python bench/scale.py [--steps 5] [--json out.json]

The model is tinygpt with 17 layers of width 768 (byte vocabulary: 121 M parameters, GPT-2
small's size; its 12-layer "gpt2-small" preset has 86 M), fp32, windows of 256 bytes, a global
batch of 2. For each parallelism the plain loop (the same task step, DDP's or FSDP2's own sums)
and the witnessed one run as separate torchrun jobs, so each rank's peak resident memory is its
own loop's. The recorder's time per step is split where it is spent: the ranks' row hashes
("hash"), each rank's copy of its share into the ring ("copies"), the probes' forward and the
sketch ("fingerprint"), rank 0's record and heads ("records"), and the checkpoints' gathers and
writes. The figures are ratios against the plain loop of the same run of this script; the
projection to 1.2 B and 2 B parameters on 8 ranks is computed from the measured rates and marked
as one.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {"n_layer": 17, "n_head": 12, "d_model": 768, "block": 256, "batch_size": 2, "dropout": 0.0,
          "probes": 2, "probe_len": 32, "precision": "fp32", "corpus_max_bytes": 4_000_000, "sketch_dims": 8}
SMALL = {"n_layer": 1, "n_head": 2, "d_model": 32, "block": 32}  # --small: a check that the script runs
EVERY, P = 2, 0.5  # a window every 2 steps; each step selected with probability 1/2
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class Timed:
    """Wraps a method, summing its wall time per step."""

    def __init__(self, obj: object, name: str, into: dict, key: str):
        inner = getattr(obj, name)

        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                into[key] = into.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


def worker(args: list[str]) -> None:
    """One rank of a plain or witnessed run (under torchrun); writes its figures as JSON."""
    import torch
    import torch.distributed as dist

    mode, parallelism, out, steps, report_path = args[0], args[1], Path(args[2]), int(args[3]), args[4]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from witness.task import build_task

    task = build_task("tinygpt", CONFIG | (SMALL if os.environ.get("SCALE_SMALL") else {}) | {"steps": steps})
    ds = task.dataset()
    step_t, record_t, parts = [], [], []
    figures: dict = {"rank": rank}
    if mode == "plain":
        from witness.data.order import derive_run_seed

        # the model built as the witnessed run builds it, in the framework's own wrapper with its own
        # sums (no rank-ordered hook, no recorder)
        seed = derive_run_seed(ds.root, b"\x07" * 32)
        model = task.build_model(seed)
        if parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for unit in task.fsdp_units(model):
                fully_shard(unit)
            model = fully_shard(model)
        opt = task.build_optimizer(model)
        for t in range(steps):
            mine = [(RANKS * t + rank) % len(ds)]  # this rank's one sample of the global batch of 2
            t0 = time.perf_counter()
            batch = task.collate([ds.sample_bytes(i) for i in mine])
            task.train_step(model, opt, batch, task.schedule.at(t), t)
            step_t.append(time.perf_counter() - t0)
    else:
        from witness.commit.signing import load_key
        from witness.distributed import DistRecorder
        from witness.record import Commitments, Online, OnlineSpec

        online = None
        if rank == 0:
            from witness.beacon.drand import DrandClient
            from witness.beacon.windows import WitnessedLink
            from witness.beacon.witness_client import WitnessClient
            from witness.commit.drand import chain_info

            urls = json.loads(os.environ["SCALE_WITNESSES"])
            link = WitnessedLink([WitnessClient(u) for u in urls],
                                 DrandClient(os.environ["SCALE_DRAND"], chain_info(Path(os.environ["SCALE_CHAIN"]))))
            online = Online(beacon=link, spec=OnlineSpec.for_steps(steps, every=EVERY, p=P, drand=link.chain.hash.hex()))
        key = load_key(os.environ["SCALE_KEY"]) if rank == 0 else None
        rec = DistRecorder(task, out, key, r=b"\x07" * 32, commit=Commitments(checkpoint_every=steps),
                           parallelism=parallelism, online=online)
        split: dict = {}
        Timed(rec, "_hash_shards", split, "hash")
        Timed(rec, "_keep", split, "copies")  # (its chunk tree and the openings' gather are taken out below)
        if rec._chunks is not None:
            Timed(rec._chunks, "param_root", split, "chunk_tree")
            Timed(rec._chunks, "gather", split, "openings")
        Timed(rec.session, "fingerprint", split, "fingerprint")
        Timed(rec.session, "sketch", split, "fingerprint")
        Timed(rec.session, "full_state", split, "checkpoint")
        if rec.inner is not None:
            Timed(rec.inner, "log_step", split, "records")  # (its self-check is taken out below)
            if rec.inner.self_check is not None:
                for name in ("prepare", "finish", "settle"):  # (all within log_step)
                    Timed(rec.inner.self_check, name, split, "self_check")
        ring = rec.inner.online if rec.inner is not None else rec._ring
        trees = [0.0]
        for t in range(steps):
            t0 = time.perf_counter()
            batch = rec.batch(t)
            out_ = rec.train_step(t, batch)
            t1 = time.perf_counter()
            split.clear()
            rec.log_step(t, out_)
            t2 = time.perf_counter()
            step_t.append(t1 - t0)
            record_t.append(t2 - t1)
            tree = ring.report()["tree_seconds"] if ring is not None else 0.0  # the ring's subtrees, this step
            # _keep's time holds the ring's copy, its subtree (T), the openings' gather and the param_root's
            gathered, root, subtree = split.get("openings", 0.0), split.get("chunk_tree", 0.0), tree - trees[0]
            split["copies"] = split.get("copies", 0.0) - gathered - root - subtree
            split["chunk_tree"] = root + subtree
            trees[0] = tree
            if "self_check" in split:
                split["records"] = split.get("records", 0.0) - split["self_check"]
            parts.append(dict(split))
        t0 = time.perf_counter()
        rec.finish()
        figures["finish_s"] = time.perf_counter() - t0
        figures["online"] = rec.report()
        pieces = rec.session.shard_pieces()[0]
        figures["share_bytes"] = sum(v.numel() * v.element_size() for v in pieces.values())
        figures["params"] = sum(p.numel() for p in rec.session.module.parameters())
    figures |= {"step_s": step_t, "record_s": record_t, "parts": parts, "peak_rss": _peak_rss()}
    Path(f"{report_path}.{rank}").write_text(json.dumps(figures))
    dist.barrier()
    os._exit(0)  # the bundle is durable (finish fsyncs); skip the process group's teardown


def _torchrun(mode: str, parallelism: str, out: Path, steps: int, report: Path, env: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", __file__, "--worker", mode, parallelism, str(out), str(steps), str(report)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | env, timeout=3600)
    if res.returncode:
        raise SystemExit(f"{mode} {parallelism} failed:\n{res.stderr[-4000:]}")
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in range(RANKS)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 2 else xs)  # the first step warms caches


def _split(ranks: list[dict]) -> dict:
    """Each part's median seconds per step, the slowest rank's (the ranks wait for each other)."""
    keys = {k for r in ranks for p in r["parts"] for k in p}
    return {k: max(_median([p.get(k, 0.0) for p in r["parts"]]) for r in ranks) for k in sorted(keys)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import parser, report

    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--parallelism", nargs="+", default=["fsdp", "ddp"])
    ap.add_argument("--small", action="store_true", help="a tiny model: check that the script runs")
    args = ap.parse_args()

    from witness.beacon.app import create_app
    from witness.beacon.drand import LocalDrand
    from witness.beacon.drand import create_app as drand_app
    from witness.beacon.witness_client import WitnessClient
    from witness.commit.drand import chain_info
    from witness.commit.signing import generate_key, save_key
    from witness.verify import Policy, Trust, Verifier
    from witness.verify.online import WitnessTrust
    from witness.web import start_uvicorn, stop_uvicorn

    tmp = Path(tempfile.mkdtemp(prefix="witness-scale-"))
    drand = LocalDrand(seed=b"\x31" * 32, period=1)
    (tmp / "chain.json").write_text(json.dumps(drand.chain.to_json()))
    servers = [start_uvicorn(drand_app(drand))]
    wkeys = [generate_key() for _ in range(2)]
    names = ["w1.example", "w2.example"]
    for i, k in enumerate(wkeys):
        servers.append(start_uvicorn(create_app(f"sqlite:///{tmp / f'w{i}.db'}", k, name=names[i])))
    save_key(generate_key(), tmp / "key.pem")
    env = {"SCALE_WITNESSES": json.dumps([s[2] for s in servers[1:]]), "SCALE_DRAND": servers[0][2],
           "SCALE_CHAIN": str(tmp / "chain.json"), "SCALE_KEY": str(tmp / "key.pem"), "OMP_NUM_THREADS": "1"} | ({"SCALE_SMALL": "1"} if args.small else {})
    trust = Trust(witnesses=WitnessTrust(tuple(WitnessClient(s[2]).key for s in servers[1:]), 2,
                                         chain_info(tmp / "chain.json")))
    figures: dict = {"config": CONFIG, "ranks": RANKS, "steps": args.steps, "every": EVERY, "p": P,
                     "machine": f"{os.cpu_count()} CPU cores", "runs": {}}
    try:
        for par in args.parallelism:
            plain = _torchrun("plain", par, tmp / f"plain_{par}", args.steps, tmp / f"plain_{par}.json", env)
            wit = _torchrun("witnessed", par, tmp / f"run_{par}", args.steps, tmp / f"wit_{par}.json", env)
            bundle = tmp / f"run_{par}"
            plain_step = max(_median(r["step_s"]) for r in plain)
            step = max(_median(r["step_s"]) for r in wit)
            record = max(_median(r["record_s"]) for r in wit)
            size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
            checkpoints = sum(f.stat().st_size for f in (bundle / "checkpoints").iterdir())
            t0 = time.perf_counter()
            v_on = Verifier(trust, Policy(mode="online", bad_fraction=0.5)).verify(bundle)
            online_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            v_off = Verifier(policy=Policy(challenges=2)).verify(bundle)
            offline_s = time.perf_counter() - t0
            ring = max(r["online"]["peak_ring"] for r in wit) * max(r["share_bytes"] for r in wit)
            figures["runs"][par] = {
                "params": wit[0]["params"], "state_bytes": sum(r["share_bytes"] for r in wit),
                "plain_step_s": plain_step, "witnessed_train_step_s": step, "recorder_s_per_step": record,
                "recorder_ratio": record / plain_step, "witnessed_step_ratio": (step + record) / plain_step,
                "recorder_split_s": _split(wit), "finish_s": max(r["finish_s"] for r in wit),
                "peak_rss_plain": [r["peak_rss"] for r in plain], "peak_rss_witnessed": [r["peak_rss"] for r in wit],
                "peak_rss_ratio": max(w["peak_rss"] / p["peak_rss"] for w, p in zip(wit, plain, strict=True)),
                "ring_bytes_per_rank": ring, "peak_ring": [r["online"]["peak_ring"] for r in wit],
                "waits": wit[0]["online"].get("waits"), "wait_seconds": wit[0]["online"].get("wait_seconds"),
                "bundle_bytes": size, "checkpoint_bytes": checkpoints,
                "online_bytes_per_step": sum(f.stat().st_size for f in (bundle / "online").rglob("*") if f.is_file())
                / args.steps,
                "log_and_heads_bytes_per_step": sum((bundle / n).stat().st_size for n in ("log.jsonl", "heads.jsonl"))
                / args.steps,
                "online": {"accepted": v_on.accepted, "replayed_steps": v_on.replayed_steps, "seconds": online_s,
                           "s_per_replayed_step": online_s / max(v_on.replayed_steps, 1)},
                "offline": {"accepted": v_off.accepted, "replayed_steps": v_off.replayed_steps, "seconds": offline_s,
                            "s_per_replayed_step": offline_s / max(v_off.replayed_steps, 1)},
            }
            shutil.rmtree(tmp / f"plain_{par}", ignore_errors=True)
    finally:
        for server, thread, _ in servers:
            stop_uvicorn(server, thread)
    figures["projection"] = project(figures["runs"])
    report(figures, args.json)
    shutil.rmtree(tmp, ignore_errors=True)


def project(runs: dict) -> dict:
    """A projection, not a measurement: the recorder's per-step cost at 1.2 B and 2 B parameters on 8
    ranks, from the rates measured here (bytes hashed and copied per second per rank), each rank
    holding 1/8 of a state of 12 bytes a parameter (fp32 weights and AdamW's two moments)."""
    run = runs.get("fsdp") or next(iter(runs.values()))
    share = run["state_bytes"] / RANKS
    split = run["recorder_split_s"]
    # bytes a second one rank (one core here) hashes, copies into its ring, and lays out and hashes as chunks
    # (the chunk tree covers the parameters: a third of the state's 12 bytes a parameter)
    rates = {k: (share / 3 if k == "chunk_tree" else share) / split[k] for k in ("hash", "copies", "chunk_tree")
             if split.get(k)}
    out = {"note": "PROJECTION from this machine's measured per-rank rates (one CPU core a rank), not a measurement",
           "rates_bytes_per_s": rates, "tokens_per_step": 2**19}
    for name, n in (("1.2B", 1.2e9), ("2B", 2.0e9)):
        per_rank = 12 * n / 8
        out[name] = {"state_bytes_per_rank": per_rank,
                     **{f"{k}_s_per_step": (per_rank / 3 if k == "chunk_tree" else per_rank) / r for k, r in rates.items()},
                     "train_flops_per_step": 6 * n * 2**19}
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
