"""Write a nanoGPT data folder from the Python standard library's sources, byte-level: the text
nanoGPT's own prepare scripts would download, without a download. ``data/stdlib_char/`` then has
``train.bin`` and ``val.bin`` (uint16 tokens, nanoGPT's format) and ``meta.pkl`` with the vocabulary
size that train.py reads (witness never reads it: the recipe takes the size from the model).

    python prepare_stdlib.py [--bytes 1000000]    # then: python train.py --dataset=stdlib_char ...
"""

import argparse
import pickle
import sysconfig
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1_000_000, help="bytes of text in all (a tenth for val.bin)")
    ap.add_argument("--out", default="data/stdlib_char", help="the dataset's folder")
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for p in sorted(root.rglob("*.py")):  # in path order, tests left out
        if any(part in ("test", "tests", "idle_test", "site-packages") for part in p.relative_to(root).parts):
            continue
        text.append(p.read_bytes())
        size += len(text[-1])
        if size >= args.bytes:
            break
    tokens = np.frombuffer(b"".join(text)[: args.bytes], dtype=np.uint8).astype(np.uint16)
    split = len(tokens) * 9 // 10
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens[:split].tofile(out / "train.bin")
    tokens[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:  # nanoGPT's own format for its vocabulary
        pickle.dump({"vocab_size": 256}, f)
    print(f"wrote {out}: train.bin ({split:,} tokens), val.bin, meta.pkl")


if __name__ == "__main__":
    main()
