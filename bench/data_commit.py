"""Data commitments at scale: 1,000,000 synthetic samples.

Reports the time and peak memory to commit them (sample hashes, the dataset tree in index
order, and the sorted used tree), the size of an exclusion proof against that tree, the time to
check it, and hashing throughput against plain ``hashlib.sha256`` on the same bytes.

    python bench/data_commit.py [--samples 1000000] [--json out.json]
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import time
import tracemalloc

from common import parser, report

from witness.commit.hashing import canonical_json, leaf_hash
from witness.commit.log import RunLog
from witness.commit.merkle import MerkleTree
from witness.commit.signing import generate_key
from witness.commit.sorted_tree import SortedTree
from witness.data.dataset import sample_hash
from witness.data.proofs import check_proof, pair_to_json


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--sample-bytes", type=int, default=105)  # a tinygpt window: 40 + 65 bytes
    args = ap.parse_args()
    n = args.samples
    blob = os.urandom(n * args.sample_bytes)
    samples = [blob[i * args.sample_bytes : (i + 1) * args.sample_bytes] for i in range(n)]

    start = time.perf_counter()
    for s in samples:
        hashlib.sha256(s).digest()
    raw_s = time.perf_counter() - start

    def commit() -> tuple[float, float, float, bytes, SortedTree]:
        t0 = time.perf_counter()
        hs = [sample_hash(s) for s in samples]
        t1 = time.perf_counter()
        MerkleTree([leaf_hash(h) for h in hs]).root()
        t2 = time.perf_counter()
        tree = SortedTree(hs)
        _ = tree.root  # the root is part of the commitment cost
        return t1 - t0, t2 - t1, time.perf_counter() - t2, hs, tree

    # Time without tracing; then once more under tracemalloc for the peak memory.
    hash_s, tree_s, sorted_s, hashes, used = commit()
    commit_s = hash_s + tree_s + sorted_s
    used_root = used.root
    del hashes, used
    tracemalloc.start()
    start = time.perf_counter()
    hashes = [sample_hash(s) for s in samples]
    dataset_root = MerkleTree([leaf_hash(h) for h in hashes]).root()
    used = SortedTree(hashes)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert used.root == used_root

    # A complete exclusion proof file: signed final head with the used-tree extension.
    key = generate_key()
    log = RunLog()
    log.append({"type": "manifest"})
    ext = {"document_rule": "self", "used_documents": {"root": used_root.hex(), "size": used.size},
           "used_samples": {"root": used_root.hex(), "size": used.size}}
    head = log.sign_head(key, extensions=ext)
    from witness.commit.signing import public_hex

    query_times, sizes = [], []
    for q in range(200):
        query = hashlib.sha256(b"absent-%d" % q).digest()
        absent = used.prove_absent(query)
        proof = {"format": "witness-data-proof", "version": 1, "kind": "exclusion", "document": query.hex(),
                 "public_key": public_hex(key.public_key()), "tree_head": head.to_json(),
                 "absence": pair_to_json(absent)}
        data = canonical_json(proof)
        sizes.append(len(data))
        parsed = json.loads(data)
        start = time.perf_counter()
        check_proof(parsed)
        query_times.append(time.perf_counter() - start)
    out = {
        "samples": n,
        "sample_bytes": args.sample_bytes,
        "commit_s": commit_s,
        "commit_breakdown_s": {"sample_hashes": hash_s, "dataset_tree": tree_s, "sorted_used_tree": sorted_s},
        "peak_python_memory_mb": peak / 2**20,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "raw_sha256_s": raw_s,
        "sample_hashing_vs_raw_sha256": hash_s / raw_s,
        "commit_vs_raw_sha256": commit_s / raw_s,
        "exclusion_proof_bytes_max": max(sizes),
        "exclusion_proof_bytes_median": statistics.median(sizes),
        "check_ms_median": 1000 * statistics.median(query_times),
        "check_ms_p95": 1000 * sorted(query_times)[int(0.95 * len(query_times))],
        "dataset_root": dataset_root.hex(),
    }
    return report(out, args.json)


if __name__ == "__main__":
    main()
