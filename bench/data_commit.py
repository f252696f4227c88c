"""Committing a pretraining corpus: a token corpus of N samples on disk (llm.c shards), committed
as one dataset, against one plain SHA-256 pass over the same bytes, in one run.

The corpus is made here (random tokens, documents of random lengths between end-of-text tokens,
shards of 100 M tokens: no download) and deleted afterwards. Each phase runs in a process of its
own, so its peak memory (max RSS) is its own:

* ``sha256``: one ``hashlib.sha256`` over every shard's bytes, read in 16 MB chunks (one core);
* ``commit``: ``TokenCorpus.commit``: every document and window hashed, the dataset root, the
  leaves file written (every core, in a stream);
* ``read``: what a verifier does with the leaves file: read it strictly and check it against the
  root, then rebuild the used-data trees of a run that trained on a tenth of the samples;
* ``proof``: an exclusion proof against the sorted tree of the corpus's documents, its size and
  the time to check it.

    python bench/data_commit.py [--samples 100000000] [--block 256] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import parser, report

SHARD_TOKENS = 100_000_000
EOT = 50256


def make_corpus(out: Path, tokens: int, seed: int = 0) -> list[Path]:
    """Shards of random GPT-2 tokens, documents of 50 to 2,000 tokens each starting with end-of-text."""
    rng = np.random.default_rng(seed)
    from witness.data.tokens import write_llmc_shard

    paths = []
    for k, lo in enumerate(range(0, tokens, SHARD_TOKENS)):
        n = min(SHARD_TOKENS, tokens - lo)
        shard = rng.integers(0, EOT, n, dtype=np.uint16)
        at = np.cumsum(rng.integers(50, 2000, n // 50 + 2))
        shard[at[at < n]] = EOT
        path = out / f"corpus_train_{k:06d}.bin"
        write_llmc_shard(path, shard)
        paths.append(path)
    return paths


def phase_sha256(d: Path) -> dict:
    """One plain SHA-256 pass over the shards' bytes."""
    started = time.perf_counter()
    h = hashlib.sha256()
    size = 0
    for p in sorted(d.glob("*.bin")):
        with open(p, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
                size += len(block)
    return {"seconds": time.perf_counter() - started, "bytes": size}


def phase_commit(d: Path, block: int, leaves: Path) -> dict:
    """The corpus's commitment and leaves file."""
    from witness.commit.batch import NATIVE, cores
    from witness.data.tokens import TokenCorpus

    corpus = TokenCorpus(d, block, eot=EOT)
    started = time.perf_counter()
    root = corpus.commit(leaves)
    return {"seconds": time.perf_counter() - started, "root": root.hex(), "samples": len(corpus),
            "tokens": corpus.tokens_total, "leaves_bytes": leaves.stat().st_size, "native": NATIVE,
            "threads": cores()}


def phase_read(leaves: Path, samples: int, root: str, used_fraction: float) -> dict:
    """A verifier's work with the leaves file: strict read, root check, used-data trees."""
    from witness.data.leaves import read_leaves

    started = time.perf_counter()
    lv, _ = read_leaves(leaves, samples=samples, rule="prefix32")
    lv.check_root(bytes.fromhex(root))
    checked = time.perf_counter()
    used = np.random.default_rng(1).choice(samples, int(samples * used_fraction), replace=False)
    (_, n_samples), (_, n_docs) = lv.used(used)
    return {"read_and_root_check_s": checked - started, "used_trees_s": time.perf_counter() - checked,
            "used_samples": n_samples, "used_documents": n_docs}


def phase_proof(leaves: Path, samples: int, proofs: int) -> dict:
    """An exclusion proof against the sorted tree of all the corpus's documents (the most a run can use)."""
    from witness.commit.hashing import canonical_json
    from witness.commit.log import RunLog
    from witness.commit.signing import generate_key, public_hex
    from witness.data.leaves import _sorted_unique, read_leaves, sorted_tree_root
    from witness.data.proofs import pair_to_json
    from witness.verify.data_queries import check_data_proof

    lv, _ = read_leaves(leaves, samples=samples, rule="prefix32")
    values = _sorted_unique(np.asarray(lv.table))
    root, size = sorted_tree_root(values)
    key = generate_key()
    log = RunLog()
    log.append({"type": "manifest"})
    ext = {"document_rule": "prefix32", "used_documents": {"root": root.hex(), "size": size},
           "used_samples": {"root": root.hex(), "size": size}, "task": "tinygpt"}
    head = log.sign_head(key, extensions=ext)
    sizes, times = [], []
    for q in range(-1, proofs):  # the first (q = -1) warms the checker's caches and is not timed
        query = hashlib.sha256(b"absent-%d" % q).digest()
        absent = sorted_pair_proof(values, query)
        proof = {"format": "witness-data-proof", "version": 2, "kind": "exclusion", "document": query.hex(),
                 "public_key": public_hex(key.public_key()), "tree_head": head.to_json(),
                 "absence": pair_to_json(absent)}
        data = canonical_json(proof)
        sizes.append(len(data))
        parsed = json.loads(data)
        t = time.perf_counter()
        check_data_proof(parsed)
        if q >= 0:
            times.append(time.perf_counter() - t)
    return {"documents": size, "exclusion_proof_bytes_max": max(sizes),
            "check_ms_median": 1000 * statistics.median(times), "check_ms_max": 1000 * max(times)}


def sorted_pair_proof(values: np.ndarray, query: bytes):
    """The sorted tree's absence proof of ``query`` over sorted ``values`` ``[n, 32]``, its audit path
    built from subtree roots hashed natively in chunks (the tree is never held whole)."""
    from witness.commit.batch import StreamingRoot, leaf_hashes
    from witness.commit.sorted_tree import PairProof, pair_leaf

    n = len(values)
    flat = np.ascontiguousarray(values).view("V32").ravel()
    i = int(np.searchsorted(flat, np.frombuffer(query, "V32")[0]))

    def leaves(lo: int, hi: int) -> bytes:  # pair leaves lo..hi-1 of the n + 1
        out = []
        if lo == 0:
            out.append(pair_leaf(None, bytes(values[0])))
            lo = 1
        inner_hi = min(hi, n)
        if inner_hi > lo:
            pairs = np.empty((inner_hi - lo, 65), np.uint8)
            pairs[:, 0] = 3
            pairs[:, 1:33], pairs[:, 33:] = values[lo - 1:inner_hi - 1], values[lo:inner_hi]
            out.append(leaf_hashes(pairs, 65))
        if hi == n + 1:
            out.append(pair_leaf(bytes(values[-1]), None))
        return b"".join(out)

    def root(lo: int, hi: int) -> bytes:
        acc, chunk = StreamingRoot(), 1 << 20
        for a in range(lo, hi, chunk):
            acc.add(leaves(a, min(hi, a + chunk)))
        return acc.root()

    def path(m: int, lo: int, hi: int) -> list[bytes]:  # RFC 6962 PATH(m, D[lo:hi])
        k = hi - lo
        if k == 1:
            return []
        split = 1 << ((k - 1).bit_length() - 1)
        if m < split:
            return path(m, lo, lo + split) + [root(lo + split, hi)]
        return path(m - split, lo + split, hi) + [root(lo, lo + split)]

    lower = bytes(values[i - 1]) if i > 0 else None
    upper = bytes(values[i]) if i < n else None
    return PairProof(i, lower, upper, n, path(i, 0, n + 1))


class AnonPeak:
    """The peak of this process's anonymous memory (RssAnon), sampled every 20 ms: what it allocated,
    without the memory-mapped corpus's pages, which the kernel may drop at any time."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now()) / 2**20


def child(args: list[str]) -> dict:
    """Run one phase in a process of its own; its figures and its peak memory."""
    out = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--block", type=int, default=256, help="tokens per window (a sample is block + 1 uint16 tokens)")
    ap.add_argument("--dir", help="where to make the corpus (default: a temporary folder); deleted afterwards")
    ap.add_argument("--phase", nargs="+", help=argparse_hidden())
    ap.add_argument("--skip-proof", action="store_true", help="leave out the exclusion-proof phase")
    ap.add_argument("--proofs", type=int, default=50, help="exclusion proofs to make and check (each hashes the "
                                                          "whole document tree once: fewer at 10^8)")
    args = ap.parse_args()
    if args.phase:
        name, *rest = args.phase
        fn = {"sha256": lambda: phase_sha256(Path(rest[0])),
              "commit": lambda: phase_commit(Path(rest[0]), int(rest[1]), Path(rest[2])),
              "read": lambda: phase_read(Path(rest[0]), int(rest[1]), rest[2], float(rest[3])),
              "proof": lambda: phase_proof(Path(rest[0]), int(rest[1]), int(rest[2]))}[name]
        peak = AnonPeak()
        figures = fn()
        figures["peak_anon_mb"] = peak.stop()
        figures["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # mapped pages too
        print(json.dumps(figures))
        return {}
    base = Path(tempfile.mkdtemp(prefix="witness-corpus-", dir=args.dir))
    try:
        corpus, leaves = base / "corpus", base / "corpus.leaves"
        corpus.mkdir()
        t0 = time.perf_counter()
        make_corpus(corpus, args.samples * args.block + 1)
        made = time.perf_counter() - t0
        sha_first = child(["sha256", str(corpus)])
        commit = child(["commit", str(corpus), str(args.block), str(leaves)])
        sha_after = child(["sha256", str(corpus)])
        plain = min(sha_first["seconds"], sha_after["seconds"])  # the faster pass: the stricter ratio
        read = child(["read", str(leaves), str(commit["samples"]), commit["root"], "0.1"])
        proof = None if args.skip_proof else child(["proof", str(leaves), str(commit["samples"]), str(args.proofs)])
        out = {
            "samples": commit["samples"], "block": args.block, "sample_bytes": 40 + 2 * (args.block + 1),
            "corpus_bytes": sha_first["bytes"], "corpus_made_s": made, "cores": os.cpu_count(),
            "plain_sha256_s": [sha_first["seconds"], sha_after["seconds"]],
            "plain_sha256_gb_per_s": sha_first["bytes"] / plain / 1e9,
            "commit": commit, "commit_vs_plain_sha256": commit["seconds"] / plain,
            "leaves_bytes_per_sample": commit["leaves_bytes"] / commit["samples"],
            "read": read, "proof": proof,
        }
        return report(out, args.json)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
