"""What every benchmark shares: its command line and how it reports."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the shared ``--json`` option."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--json", help="also write the figures to this file")
    return ap


def report(figures: dict, path: str | None) -> dict:
    """Print the figures as JSON, and write them to ``path`` if given."""
    text = json.dumps(figures, indent=2)
    print(text)
    if path:
        Path(path).write_text(text)
    return figures


def compare_runs(doc: str | None, run: Callable[[bool, int, Path], list[float]], config: dict,
                 rounds: int = 3, steps: int = 12) -> dict:
    """Plain and witnessed runs of a framework's loop, alternated in one process so that the
    machine's drift hits both alike; ``run(witnessed, steps, folder)`` returns step times.
    Reports the medians and their ratio (``--rounds``, ``--steps``, ``--batch-size``, ``--json``)."""
    import torch

    ap = parser(doc)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=config["batch_size"])
    args = ap.parse_args()
    config["batch_size"] = args.batch_size
    plain: list[float] = []
    witnessed: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for w in ((False, True) if r % 2 == 0 else (True, False)):
                (witnessed if w else plain).extend(run(w, args.steps, Path(tmp) / f"{r}-{w}"))
    p, w = statistics.median(plain), statistics.median(witnessed)
    return report({"config": config, "threads": torch.get_num_threads(), "steps_per_run": args.steps,
                   "plain_step_s": p, "witnessed_step_s": w, "overhead": w / p - 1,
                   "plain_steps": len(plain), "witnessed_steps": len(witnessed)}, args.json)
