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


def median_seconds(fn: Callable[[], object], repeat: int, warm: bool = False) -> float:
    """The median wall time of ``repeat`` calls of ``fn`` (after one more that warms caches, if ``warm``)."""
    import time

    if warm:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def report(figures: dict, path: str | None) -> dict:
    """Print the figures as JSON, and write them to ``path`` if given."""
    text = json.dumps(figures, indent=2)
    print(text)
    if path:
        Path(path).write_text(text)
    return figures


RECORDER_TIMES: list[float] = []  # seconds spent in the witness hooks, per step, of the witnessed runs


def time_hooks(obj: object, names: tuple[str, ...]) -> None:
    """Time the named methods of ``obj`` (a framework callback): each step's total goes into
    ``RECORDER_TIMES`` when the last of them returns."""
    spent = [0.0]
    last_name = names[-1]
    for name in names:
        inner = getattr(obj, name)

        def timed(*a, _inner=inner, _last=name == last_name, **k):
            import time

            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
                if _last:
                    RECORDER_TIMES.append(spent[0])
                    spent[0] = 0.0

        setattr(obj, name, timed)


def compare_runs(doc: str | None, run: Callable[[bool, int, Path], list[float]], config: dict,
                 rounds: int = 3, steps: int = 12) -> dict:
    """Plain and witnessed runs of a framework's loop, alternated in one process so that the
    machine's drift hits both alike; ``run(witnessed, steps, folder)`` returns step times.
    Reports the medians and their ratio (``--rounds``, ``--steps``, ``--batch-size``, ``--block``, ``--json``)."""
    import torch

    ap = parser(doc)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=config["batch_size"])
    ap.add_argument("--block", type=int, default=config["block"], help="tokens per sample")
    args = ap.parse_args()
    config["batch_size"], config["block"] = args.batch_size, args.block
    plain: list[float] = []
    witnessed: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for w in ((False, True) if r % 2 == 0 else (True, False)):
                (witnessed if w else plain).extend(run(w, args.steps, Path(tmp) / f"{r}-{w}"))
    p, w = statistics.median(plain), statistics.median(witnessed)
    # The whole-step difference is at the mercy of the machine's noise (steps of one run vary by
    # 10 % here); the time inside the witness hooks is measured directly, like overhead.py does.
    hooks = statistics.median(RECORDER_TIMES[1:-1] or RECORDER_TIMES)  # the first and last carry set-up and the end
    return report({"config": config, "threads": torch.get_num_threads(), "steps_per_run": args.steps,
                   "plain_step_s": p, "witnessed_step_s": w, "whole_step_difference": w / p - 1,
                   "recorder_s_per_step": hooks, "overhead": hooks / p,
                   "plain_step_spread_s": [min(plain), max(plain)],
                   "plain_steps": len(plain), "witnessed_steps": len(witnessed)}, args.json)
