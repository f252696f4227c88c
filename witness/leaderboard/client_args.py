"""A leaderboard client from command-line flags: its address, and the token given or saved for it."""

from __future__ import annotations

import argparse


def client_for(args: argparse.Namespace, need_token: bool = True):  # noqa: ANN201 - an httpx.Client
    """A client of ``args.leaderboard`` sending ``args.token`` (or the one saved for that address)."""
    from .client import connect, saved_token

    token = getattr(args, "token", None) or saved_token(args.leaderboard)
    if need_token and not token:
        raise ValueError(f"no API token for {args.leaderboard}: run `witness leaderboard register` "
                         "or set WITNESS_LEADERBOARD_TOKEN")
    return connect(args.leaderboard, token)
