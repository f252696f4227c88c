"""The chunk tree's cost per step at scale: hashing a state's parameters into 1 KiB chunks and their
tree, and the bytes a window's openings add per step, for tinygpt's bench recipe, GPT-2 small's body
(124 M parameters) and the 1.2 B preset.

The leaves are SHA-256 of each chunk (OpenSSL's, SHA-NI where the CPU has it, on the native module's
threads), then the tree's levels; both are measured here on float32 parameters laid out as the ring
lays them out, at 1 and at every core of this machine. The openings add, per step, k chunks and
their paths (32 bytes a level of the tree) for each state of a window, which holds one more state
than steps.

    python bench/chunk_tree.py [--sizes 68544,124000000,1200000000] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import numpy as np
from common import median_seconds, parser, report

from witness.commit import batch
from witness.commit.chunks import ChunkTree, chunk_leaves, path_nodes

LAYOUT = b"\x00" * 32


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", default="68544,124000000,1200000000", help="parameters (float32), comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=2, help="chunks opened per state")
    ap.add_argument("--every", type=int, default=10, help="steps a window (a head every this many steps)")
    args = ap.parse_args()
    cores = batch.cores()
    rows = {}
    for n in (int(x) for x in args.sizes.split(",")):
        chunks = -(-n * 4 // args.chunk_bytes)
        flat = np.random.default_rng(0).integers(0, 255, chunks * args.chunk_bytes, dtype=np.uint8)
        row: dict = {"parameters": n, "chunks": chunks, "bytes": int(flat.nbytes)}
        for threads in sorted({1, cores}):
            leaves = chunk_leaves(flat, args.chunk_bytes, threads)
            row[f"leaves_s_{threads}t"] = median_seconds(lambda t=threads, f=flat: chunk_leaves(f, args.chunk_bytes, t),
                                                         args.repeat, warm=True)
            row[f"levels_s_{threads}t"] = median_seconds(lambda lv=leaves: ChunkTree(lv, LAYOUT), args.repeat, warm=True)
            row[f"tree_s_{threads}t"] = row[f"leaves_s_{threads}t"] + row[f"levels_s_{threads}t"]
        row["gb_per_s_one_core"] = flat.nbytes / row["leaves_s_1t"] / 1e9
        depth = max(len(path_nodes(i, chunks)) for i in (0, chunks - 1))
        per_state = args.chunks * (args.chunk_bytes + 32 * depth)
        row["path_levels"] = depth
        row["openings_bytes_per_state"] = per_state
        row["openings_bytes_per_step"] = per_state * (args.every + 1) / args.every
        # what 16 host cores would take (the leaves split evenly; the levels are a twentieth of the work)
        row["tree_s_16_cores_projected"] = row["leaves_s_1t"] / 16 + row["levels_s_1t"]
        rows[str(n)] = row
    report({"cores": cores, "native": batch.NATIVE, "chunk_bytes": args.chunk_bytes, "chunks": args.chunks,
            "every": args.every, "sizes": rows,
            "note": "tree_s: SHA-256 of every chunk and the tree's levels, for one state"}, args.json)


if __name__ == "__main__":
    main()
