"""``witness leaderboard method WHEEL --track NAME``: submit a method to a contest track."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_method(args: argparse.Namespace) -> int:
    """Submit a wheel to a contest track; print the method's number and how to train it."""
    from ..methods.wheel import MAX_WHEEL_BYTES
    from .client import _ok
    from .client_args import client_for

    data = Path(args.wheel).read_bytes()[: MAX_WHEEL_BYTES + 1]
    params = {k: v for k, v in (("name", args.name), ("task", args.task)) if v is not None}
    with client_for(args) as c:
        m = _ok(c.post(f"/api/tracks/{args.track}/methods", params=params, content=data,
                       headers={"Content-Type": "application/octet-stream"}))
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    print(f"method {m['id']} on track {m['track']}: {m['name']} (task {m['task']}, {m['steps']} steps of "
          f"{m['batch_size']} samples, {m['params']:,} parameters; files {m['task_source']['files_sha256'][:16]}…)")
    print(f"install the wheel where you train (pip install {args.wheel}), then: witness train --leaderboard "
          f"{args.leaderboard} --track {m['track']} --method {m['id']} --out run && witness submit run --leaderboard "
          f"{args.leaderboard} --no-eval")
    return 0


def add_method_parser(lsub: argparse._SubParsersAction) -> None:
    """``witness leaderboard method``."""
    m = lsub.add_parser("method", help="submit a method (a wheel) to a contest track")
    m.add_argument("wheel", help="the method's wheel (a task plugin: model, optimizer, schedule, loss, collate)")
    m.add_argument("--leaderboard", required=True, metavar="URL", help="the leaderboard's address")
    m.add_argument("--track", required=True, help="the contest track")
    m.add_argument("--name", help="the method's name on the board (default: its distribution and version)")
    m.add_argument("--task", help="the task to run, where the wheel offers several")
    m.add_argument("--token", help="API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    m.add_argument("--json", action="store_true", help="print the method as JSON")
    m.set_defaults(func=cmd_method)
