"""Write the script's data: ``data/clm/train.txt`` (text from the Python standard library's sources)
and ``data/clm/vocab.json`` (its character vocabulary, the script's tokenizer).

    python prepare.py [--chars 60000]
"""

import argparse
import json
import sysconfig
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=60_000)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))[:40])
    text = "".join(c for c in text if c.isascii() and (c.isprintable() or c == "\n"))[: args.chars]
    out = Path("data/clm")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(text, encoding="utf-8")
    (out / "vocab.json").write_text(json.dumps({"chars": "".join(sorted(set(text)))}), encoding="utf-8")
    print(f"wrote {out / 'train.txt'} ({len(text):,} characters) and {out / 'vocab.json'}")


if __name__ == "__main__":
    main()
