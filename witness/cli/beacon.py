"""``witness beacon serve``: a standalone online-challenge beacon for a lab or a reviewer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DB = "beacon.db"
DEFAULT_BEACON_KEY = "beacon_key.pem"


def cmd_beacon_serve(args: argparse.Namespace) -> int:
    """Serve a beacon on SQLite (default) or PostgreSQL; print its public key first."""
    import uvicorn

    from ..beacon.app import create_app
    from ..commit.signing import key_fingerprint, load_or_create_key, public_hex
    from ..database import check_db_url

    key = load_or_create_key(Path(args.key))
    db = args.db or f"sqlite:///{Path(DEFAULT_DB).resolve()}"
    app = create_app(check_db_url(db), key)
    pub = public_hex(key.public_key())
    print(f"beacon public key {pub} (fingerprint {key_fingerprint(pub)}); verifiers pass it as --beacon-key",
          flush=True)
    print(f"serving on http://{args.host}:{args.port}/api/beacon (database {db.split('?')[0]})", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    b = sub.add_parser("beacon", help="the online-challenge beacon")
    bs = b.add_subparsers(dest="beacon_command", required=True)
    s = bs.add_parser("serve", help="stamp the heads training runs stream with fresh, signed randomness")
    s.add_argument("--db", help=f"database URL (default: sqlite:///{DEFAULT_DB} here; postgresql://… to scale out)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    s.add_argument("--key", default=DEFAULT_BEACON_KEY,
                   help=f"the beacon's signing key (created if missing; default {DEFAULT_BEACON_KEY})")
    s.set_defaults(func=cmd_beacon_serve)
