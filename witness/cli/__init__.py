"""The ``witness`` command line, one module per command group.

Exit codes of ``verify``: 0 accepted, 1 rejected, 2 unusable input.
"""

from __future__ import annotations

import argparse
import errno
import sys

from ..errors import VerificationError
from . import audit, data, evals, run
from .args import DEFAULT_KEY, one_line, unusable_or_rejected


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="witness", description="Certify neural-network training runs.")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (run, audit, data, evals):
        group.add_parsers(sub)
    from ..leaderboard.cli import add_parsers

    add_parsers(sub, str(DEFAULT_KEY))
    return p


def _os_error(e: OSError) -> str:
    """An ``OSError`` as a person reads it: what went wrong, and where."""
    if e.strerror is None:
        return one_line(str(e))
    where = e.filename if e.filename is not None else ""
    where = str(where) if len(str(where)) <= 120 else f"{str(where)[:60]}…({len(str(where))} characters)"
    full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    hint = " (out of space: free some; a training run then continues with witness train --resume)" if full else ""
    return one_line(f"{e.strerror}{': ' + where if where else ''}{hint}")


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and bool(args.leaderboard) != bool(args.track):
        parser.error("--leaderboard and --track go together")
    try:
        return args.func(args)
    except VerificationError as e:
        print(unusable_or_rejected(e), file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a path too long, a folder for a file, a full disk, no permission, ...
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        import httpx

        from ..leaderboard.client import LeaderboardError

        if isinstance(e, LeaderboardError):
            print(f"the leaderboard refused: {e}", file=sys.stderr)
            return 2
        if isinstance(e, httpx.TransportError):
            print(f"cannot reach the leaderboard: {e}", file=sys.stderr)
            return 2
        raise
