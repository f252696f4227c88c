"""The ``witness`` command line, one module per command group.

Exit codes of ``verify``: 0 accepted, 1 rejected, 2 unusable input.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from pathlib import Path

from ..bundle.layout import LOG
from ..errors import VerificationError
from . import audit, beacon, data, demo, drand, evals, operator, run
from .args import DEFAULT_KEY, one_line, unusable_or_rejected


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (built once: a parser parses any number of command
    lines, and building this one costs more than most commands that fail on their input)."""
    p = argparse.ArgumentParser(prog="witness", description="Certify neural-network training runs.")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (run, demo, audit, data, evals, beacon, drand, operator):
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


SIGPIPE_EXIT = 141  # what a shell reports for a process a closed pipe stopped (128 + SIGPIPE)


def _closed_pipe() -> int:
    """The reader of our output went away (``| head``): stop quietly, as ``cat`` would."""
    # Python flushes stdout again at exit; point it at /dev/null so that flush cannot raise.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (an in-process caller captured it)
        pass
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    """Entry point: every command, and a quiet stop when the reader of its output goes away."""
    try:
        return _main(argv)
    except BrokenPipeError:  # also from --help, which prints before any command runs
        return _closed_pipe()


def _resume_hint(args: argparse.Namespace) -> str:
    """What a training run stopped by its beacon or witnesses keeps, and how it goes on."""
    out = getattr(args, "out", None)
    if args.command != "train" or not out or not (Path(out) / LOG).exists():
        return ""
    return ("; the bundle keeps every record and answer so far: the same command with --resume goes on from "
            "them (and settles the audit of a run whose steps are all trained) once it answers again")


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and bool(args.leaderboard) != bool(args.track):
        parser.error("--leaderboard and --track go together")
    try:
        from ..data.locate import data_dirs

        with data_dirs(getattr(args, "data_dirs", None) or []):
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here when the output was buffered
        return code
    except BrokenPipeError:
        raise
    except VerificationError as e:
        print(unusable_or_rejected(e), file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        from ..record.selfcheck import SelfCheckFailed

        # the self-check's message says how to fix the loop: never cut (other errors stay one short line)
        print(f"error: {one_line(str(e), None if isinstance(e, SelfCheckFailed) else 300)}", file=sys.stderr)
        return 2
    except OSError as e:  # a path too long, a folder for a file, a full disk, no permission, ...
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        import httpx

        from ..beacon.client import BeaconError
        from ..leaderboard.client import LeaderboardError

        if isinstance(e, LeaderboardError):
            print(f"the leaderboard refused: {e}", file=sys.stderr)
            return 2
        if isinstance(e, BeaconError):
            print(f"error: {one_line(str(e))}{_resume_hint(args)}", file=sys.stderr)
            return 2
        if isinstance(e, httpx.TransportError):
            where = "the beacon" if getattr(args, "beacon", None) else "the leaderboard"
            print(f"cannot reach {where}: {e}{_resume_hint(args)}", file=sys.stderr)
            return 2
        # a crash is never a verdict: exit 1 is a rejection's, so an unforeseen error is 2, with its traceback
        import traceback

        traceback.print_exc()
        print(f"error: witness {args.command} stopped on an error it did not foresee ({type(e).__name__}: "
              f"{one_line(str(e))}); nothing was decided (exit 2). Please report it with the traceback above",
              file=sys.stderr)
        return 2
