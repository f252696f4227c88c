"""``witness operator serve``: one long-lived log of many runs' heads, cosigned by tlog-witnesses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .args import positive
from .beacon import database_url, port

DEFAULT_DB = "operator.db"
DEFAULT_KEY = "operator_key.pem"


def cmd_operator_serve(args: argparse.Namespace) -> int:
    """Serve an operator log on SQLite or PostgreSQL; print its origin and note key first (what every
    witness is configured with, and what verifiers pin)."""
    import uvicorn

    from ..beacon.operator import OperatorLog
    from ..beacon.operator_app import create_app
    from ..beacon.operator_db import create_tables
    from ..beacon.witness_client import WitnessClient
    from ..commit.signing import load_or_create_key
    from ..database import check_db_url, make_engine, sessions, shown_url
    from ..web import timed_http

    key = load_or_create_key(Path(args.key))
    db = check_db_url(database_url(args.db or DEFAULT_DB))
    engine = make_engine(db)
    create_tables(engine)
    witnesses = [WitnessClient(url, vkey=vkey, prefix="", ask_key=False) for url, vkey in args.witness]
    log = OperatorLog(sessions(engine), key, args.origin, witnesses, args.quorum)
    print(f"operator log {log.origin} signs as {log.vkey.vkey()}", flush=True)
    print(f"configure each witness with that key (witness beacon serve --log VKEY); {log.required} of its "
          f"{len(witnesses)} witnesses cosign each checkpoint", flush=True)
    print(f"serving on http://{args.host}:{args.port}/api/operator (database {shown_url(db)}, {log.tree.size} "
          "entries)", file=sys.stderr, flush=True)
    # one process: the tree of entries lives in it (an entry's index is its place there)
    uvicorn.run(create_app(log, per_minute=args.per_minute), host=args.host, port=args.port, log_level="warning",
                http=timed_http(), proxy_headers=False)
    return 0


def witness_at(value: str) -> tuple[str, str]:
    """``URL=VKEY``: a witness's add-checkpoint URL prefix (its path ends before ``/add-checkpoint``) and
    its cosigner vkey (type 0x04 or 0x06)."""
    from ..commit.note import COSIGNER_TYPES, NoteKey
    from ..errors import MalformedInput

    url, sep, vkey = value.partition("=")
    if not sep or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--witness {value[:80]!r}: URL=VKEY (the URL before /add-checkpoint)")
    try:
        key = NoteKey.parse(vkey)
    except MalformedInput as e:
        raise argparse.ArgumentTypeError(f"--witness {value[:80]!r}: {e}") from None
    if key.alg not in COSIGNER_TYPES:
        raise argparse.ArgumentTypeError(f"--witness {value[:80]!r}: a cosigner key is of type 0x04 or 0x06")
    return url.rstrip("/"), vkey


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    o = sub.add_parser("operator", help="an operator's log: many runs' heads in one log that public witnesses cosign")
    os_ = o.add_subparsers(dest="operator_command", required=True)
    s = os_.add_parser("serve", help="serve an operator log (its runs register and send their heads here)")
    s.add_argument("--origin", required=True,
                   help="the log's origin (a schema-less URL naming it, e.g. lab.example/witness-log)")
    s.add_argument("--witness", type=witness_at, action="append", required=True, metavar="URL=VKEY",
                   help="a witness configured for this log: its URL (before /add-checkpoint) and its cosigner vkey; "
                        "repeat for each")
    s.add_argument("--quorum", type=positive, default=None,
                   help="witnesses that must cosign each checkpoint (default: all of them)")
    s.add_argument("--key", default=DEFAULT_KEY, help=f"the log's signing key (created if missing; default {DEFAULT_KEY})")
    s.add_argument("--db", help=f"a SQLite file's path or a database URL (default: {DEFAULT_DB} here)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8300, help="port (default 8300)")
    s.add_argument("--per-minute", type=positive, default=1200, help="requests a minute one address may make")
    s.set_defaults(func=cmd_operator_serve)
