"""Write the example's token files: the Python standard library's own sources as byte tokens
(uint16, nanoGPT's headerless ``.bin``), split into ``train.bin`` and ``val.bin``.

    python prepare.py [--out data] [--bytes 1000000]
"""

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def stdlib_text(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's .py files, in path order, tests left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in ("test", "tests", "idle_test", "site-packages") for part in rel):
            continue
        data = p.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(out)[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data", help="the folder to write train.bin and val.bin to")
    ap.add_argument("--bytes", type=int, default=1_000_000, help="bytes of text in all (a tenth for val.bin)")
    args = ap.parse_args()
    tokens = np.frombuffer(stdlib_text(args.bytes), dtype=np.uint8).astype(np.uint16)
    split = len(tokens) * 9 // 10
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens[:split].tofile(out / "train.bin")
    tokens[split:].tofile(out / "val.bin")
    print(f"wrote {out / 'train.bin'} ({split:,} tokens) and {out / 'val.bin'} ({len(tokens) - split:,} tokens)")


if __name__ == "__main__":
    main()
