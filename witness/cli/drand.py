"""``witness drand serve``: a local drand-compatible endpoint (one signer) for tests and the demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .args import hex_bytes, parsed
from .beacon import port


def cmd_drand_serve(args: argparse.Namespace) -> int:
    """Serve a local drand chain on 127.0.0.1; write its chain info first, for verifiers to pin."""
    from ..beacon.drand import LocalDrand, create_app
    from ..web import serve_until_interrupted, start_uvicorn

    local = LocalDrand(seed=args.seed, period=args.period, genesis_time=args.genesis)
    info = local.chain
    if args.info_out:
        out = Path(args.info_out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(info.to_json(), indent=1) + "\n")
        os.replace(tmp, out)  # a reader never sees half a file
    server, thread, url = start_uvicorn(create_app(local), port=args.port)
    pinned = f"--drand {args.info_out}" if args.info_out else "its info (--info-out FILE) with --drand FILE"
    print(f"drand chain {info.hash.hex()} (beacon id {info.beacon_id}, a round every {info.period} s) at {url}",
          flush=True)
    print(f"a local chain of one signer, for tests and demos only; verifiers pin {pinned}"
          + (" (its key comes from --seed: anyone who knows the seed can sign its rounds)" if args.seed else ""),
          file=sys.stderr, flush=True)
    return serve_until_interrupted(server, thread)


def period(value: str) -> int:
    """A round period in whole seconds (drand's are whole seconds): 1 to 3600."""
    n = parsed(value, int, "a whole number of seconds")
    if not 1 <= n <= 3600:
        raise argparse.ArgumentTypeError(f"a period is 1 to 3600 seconds, not {n}")
    return n


def genesis(value: str) -> int:
    """A genesis time in Unix seconds."""
    n = parsed(value, int, "a time in whole Unix seconds")
    if not 0 <= n < 1 << 40:
        raise argparse.ArgumentTypeError(f"{n} is not a Unix time in seconds")
    return n


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    d = sub.add_parser("drand", help="drand randomness rounds (a local endpoint for tests and the demo)")
    ds = d.add_subparsers(dest="drand_command", required=True)
    s = ds.add_parser("serve", help="serve a local drand-compatible chain on 127.0.0.1 (drand's HTTP API)")
    s.add_argument("--port", type=port, default=8200, help="port (default 8200; 0: one the system picks)")
    s.add_argument("--period", type=period, default=3, help="seconds between rounds (default 3, as quicknet)")
    s.add_argument("--info-out", metavar="FILE",
                   help="write the chain's info JSON here (what a verifier pins with --drand FILE)")
    s.add_argument("--seed", type=hex_bytes,
                   help="derive the signing key from these hex bytes (reproducible; default: a fresh key)")
    s.add_argument("--genesis", type=genesis,
                   help="when round 1 is due, in Unix seconds (default: now); with --seed, the same chain again")
    s.set_defaults(func=cmd_drand_serve)
