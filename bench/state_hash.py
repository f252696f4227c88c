"""What committing the whole training state at every step costs, against the training step itself.

For each reference configuration: the state's size (parameters, buffers, AdamW moments), the
median time of a plain training step, and the time to hash the whole state with BLAKE3 and with
SHA-256, each as a fraction of the step. Then, for both tinygpt configurations, three loops in
interleaved blocks: plain steps, steps that hash the state inline (what the recorder does), and
steps that hash it on a thread of its own while the next step's forward and backward run (the
optimizer step waits for it). The ratios decide between committing every step and every K
steps, and whether hashing off the training thread pays. Also what an FSDP2 run over 8 ranks
pays for its sharded digest: one rank's rows, and the verifier's split of the whole tensors.

And the hashes' own speed over one buffer (``--mib``, 256 by default), on one core and on two: the
project's BLAKE3 with its chaining values (``witness.commit.blake3tree``, the one pass that also keeps
the levels an opening's path needs), the ``blake3`` package (the same digest, no chaining values out)
and OpenSSL's SHA-256 (the chunk tree of version 3 runs), in GB/s.

    python bench/state_hash.py [--threads 2] [--repeat 20] [--mib 256] [--json out.json]
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from common import median_seconds, parser, report

from witness.bundle.state import shard_digests, shard_rows, state_hash, state_tensors
from witness.commit import blake3tree
from witness.session import TrainingSession
from witness.task import build_task

CONFIGS = {
    "tiny (420 parameters)": ("tiny", {}),
    "tinycnn (BatchNorm CNN)": ("tinycnn", {}),
    "tinygpt demo (0.44 M, 1,024 tokens/step)": ("tinygpt", {}),
    "tinygpt bench (3.26 M, 8,192 tokens/step)": ("tinygpt", {"n_layer": 4, "d_model": 256, "n_head": 8,
                                                              "batch_size": 64, "block": 128}),
}


def _session(name: str, config: dict) -> tuple[TrainingSession, list[list[bytes]]]:
    task = build_task(name, dict(config, steps=1000))
    ds = task.dataset()
    session = TrainingSession(task, b"\x01" * 32, len(ds))
    batches = [[ds.sample_bytes(i) for i in session.batch_indices(t)] for t in range(8)]
    session.step(0, batches[0])  # the optimizer's moments exist from here on
    return session, batches


def measure(session: TrainingSession, batch: list[bytes], repeat: int) -> dict:
    """Step time and hash time (both digests) of one session."""
    state = state_tensors(session.model, session.optimizer)
    size = sum(t.numel() * t.element_size() for t in state.values())
    counter = iter(range(1, 10**9))
    step = median_seconds(lambda: session.step(next(counter), batch), max(3, repeat // 4))
    blake = median_seconds(lambda: state_hash(state_tensors(session.model, session.optimizer), "blake3"), repeat)
    sha = median_seconds(lambda: state_hash(state_tensors(session.model, session.optimizer), "sha256"), repeat)
    return {"state_bytes": size, "step_s": step, "blake3_s": blake, "sha256_s": sha,
            "blake3_fraction_of_step": blake / step, "sha256_fraction_of_step": sha / step,
            "blake3_GBps": size / blake / 1e9, "sha256_GBps": size / sha / 1e9,
            "fsdp_8_ranks": sharded(state, 8, repeat)}


def sharded(state: dict[str, torch.Tensor], ranks: int, repeat: int) -> dict:
    """An FSDP2 run's sharded digest: what one rank hashes (its rows), and what a verifier holding
    the whole tensors pays to split and hash them (the same bytes, ``ranks`` calls per tensor)."""
    digest = f"blake3/{ranks}"
    pieces = {n: t if t.dim() == 0 else t[slice(*shard_rows(t.shape[0], ranks)[0])] for n, t in state.items()}
    rank = median_seconds(lambda: shard_digests(pieces, digest), repeat)
    whole = median_seconds(lambda: state_hash(state, digest), repeat)
    return {"one_rank_s": rank, "verifier_whole_state_s": whole}


def per_config(repeat: int) -> dict:
    """``measure`` for every configuration."""
    out = {}
    for label, (name, config) in CONFIGS.items():
        session, batches = _session(name, config)
        out[label] = measure(session, batches[0], repeat)
    return out


def inline_vs_thread(label: str, rounds: int) -> dict:
    """Plain, inline-hash and background-hash steps of one configuration, interleaved (ABC, CBA)."""
    session, batches = _session(*CONFIGS[label])
    task, model, opt = session.task, session.model, session.optimizer
    step_no = iter(range(1, 10**9))

    def forward_backward(t: int) -> None:
        for group in opt.param_groups:
            group["lr"] = session.lr(t)
        opt.zero_grad(set_to_none=True)
        model.train()
        task.loss(model, task.collate(batches[t % 8]), torch.Generator().manual_seed(t)).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=False)

    def plain() -> None:
        t = next(step_no)
        forward_backward(t)
        opt.step()

    def inline() -> None:
        t = next(step_no)
        forward_backward(t)
        opt.step()
        state_hash(state_tensors(model, opt), "blake3")

    pending: list[threading.Thread] = []

    def background() -> None:
        t = next(step_no)
        forward_backward(t)  # overlaps the previous step's hash
        if pending:
            pending.pop().join()  # the state may change only once it is hashed
        opt.step()
        th = threading.Thread(target=lambda: state_hash(state_tensors(model, opt), "blake3"))
        th.start()
        pending.append(th)

    kinds = {"plain": plain, "inline": inline, "thread": background}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for k in order:
            for _ in range(3):
                t0 = time.perf_counter()
                kinds[k]()
                times[k].append(time.perf_counter() - t0)
            if pending:  # the block's last hash still runs: its wait counts to its step
                t0 = time.perf_counter()
                pending.pop().join()
                times[k][-1] += time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": label, "plain_step_s": med["plain"], "inline_hash_step_s": med["inline"],
            "thread_hash_step_s": med["thread"], "inline_overhead": med["inline"] / med["plain"] - 1,
            "thread_overhead": med["thread"] / med["plain"] - 1}


def throughput(mib: int, repeat: int) -> dict:
    """GB/s of each hash over one buffer of ``mib`` MiB, on 1 and 2 threads (best of ``repeat``)."""
    import hashlib

    import blake3
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    out: dict = {"mib": mib, "native": blake3tree.NATIVE}
    for threads in (1, 2):
        runs = {"witness_blake3_tree": lambda t=threads: blake3tree.tree(data, blake3tree.KEEP_FROM, t),
                "blake3_package": lambda t=threads: blake3.blake3(data, max_threads=t).digest()}
        if threads == 1:  # (hashlib's SHA-256 is one stream: one core)
            runs["openssl_sha256"] = lambda: hashlib.sha256(data).digest()
        for name, fn in runs.items():
            best = min(median_seconds(fn, 1) for _ in range(max(1, repeat // 4)))
            out[f"{name}_gbps_{threads}t"] = data.nbytes / best / 1e9
    out["tree_to_package_1t"] = out["witness_blake3_tree_gbps_1t"] / out["blake3_package_gbps_1t"]
    out["tree_to_sha256_1t"] = out["witness_blake3_tree_gbps_1t"] / out["openssl_sha256_gbps_1t"]
    return out


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--only-throughput", action="store_true", help="the hashes' speed alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    speed = throughput(args.mib, args.repeat)
    if args.only_throughput:
        return report({"throughput": speed}, args.json)
    labels = list(CONFIGS)
    return report({"threads": args.threads, "throughput": speed, "configs": per_config(args.repeat),
                   "inline_vs_thread": [inline_vs_thread(labels[2], 5 * args.rounds),
                                        inline_vs_thread(labels[3], args.rounds)]}, args.json)


if __name__ == "__main__":
    main()
