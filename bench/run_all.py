"""Run every benchmark and write their figures to bench/results/ (see docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHES = ["overhead.py", "state_hash.py", "verifier_cost.py", "attack_detection.py", "data_commit.py", "eval_cost.py",
           "leaderboard.py", "upload_memory.py", "hf_overhead.py", "lightning_overhead.py", "online_cost.py",
           "chunk_tree.py", "swap_detection.py", "honest_online.py"]


def main() -> int:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    for name in BENCHES:
        print(f"== {name}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / name), "--json", str(out / name.replace(".py", ".json"))])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
