"""``witness beacon serve``: a standalone online-challenge beacon for a lab or a reviewer."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .args import parsed, positive, seconds

DEFAULT_DB = "beacon.db"
DEFAULT_BEACON_KEY = "beacon_key.pem"
DEFAULT_COSIGNER_KEY = "witness_mldsa44.pem"


def cmd_beacon_serve(args: argparse.Namespace) -> int:
    """Serve a beacon on SQLite (default) or PostgreSQL; print its public key first."""
    import uvicorn

    from ..beacon.app import create_app
    from ..commit.signing import key_fingerprint, load_or_create_key, public_hex
    from ..database import check_db_url, shown_url
    from ..web import timed_http

    key = load_or_create_key(Path(args.key))
    cosigner = _cosigner_key(args)
    db = database_url(args.db or DEFAULT_DB)
    app = create_app(check_db_url(db), key, per_minute=args.per_minute, name=args.name,  # its tables made once, here
                     cosigner_key=cosigner, known=tuple(args.log))
    pub = public_hex(key.public_key())
    print(f"beacon public key {pub} (fingerprint {key_fingerprint(pub)}); verifiers pass it as --beacon-key",
          flush=True)
    witness = app.state.witness
    print(f"witness {witness.name} cosigns checkpoints as {witness.vkey}", flush=True)
    print(f"serving on http://{args.host}:{args.port}/api/beacon (database {shown_url(db)}"
          + (f", {args.workers} worker processes" if args.workers > 1 else "") + ")", file=sys.stderr, flush=True)
    # headers in within a time limit (a client that trickles them holds a connection no longer), and
    # no X-Forwarded-For taken from anyone: the rate limit counts the address that connected
    served = {"host": args.host, "port": args.port, "log_level": "warning",
              "http": timed_http(args.header_timeout), "proxy_headers": False}
    if args.workers == 1:
        uvicorn.run(app, **served)
        return 0
    # several processes share the database (one draw per window is its conditional update, not a lock
    # in a process); each builds the app from what this one checked
    os.environ.update(WITNESS_BEACON_DB=db, WITNESS_BEACON_KEY=str(Path(args.key).resolve()),
                      WITNESS_BEACON_PER_MINUTE=str(args.per_minute), WITNESS_BEACON_NAME=args.name or "",
                      WITNESS_BEACON_COSIGNER_KEY=str(Path(args.cosigner_key).resolve()) if cosigner else "",
                      WITNESS_BEACON_LOGS=" ".join(k.vkey() for k in args.log))
    # uvicorn hands its workers a pickled config: each imports the header timer by name, and reads its
    # limit from the environment (witness.web.TimedHTTP)
    os.environ["WITNESS_HEADER_TIMEOUT"] = str(args.header_timeout)
    served["http"] = "witness.web:TimedHTTP"
    uvicorn.run("witness.beacon.app:served_app", factory=True, workers=args.workers, **served)
    return 0


def _cosigner_key(args: argparse.Namespace):  # noqa: ANN202 - an ML-DSA-44 private key or None
    """The ML-DSA-44 key the witness cosigns with (``--cosigner ml-dsa-44``), created if missing; None:
    cosignature/v1 with the beacon's Ed25519 key."""
    from ..commit.signing import load_or_create_key

    if args.cosigner == "ed25519":
        return None
    return load_or_create_key(Path(args.cosigner_key), "ml-dsa-44")


def log_vkey(value: str):  # noqa: ANN201 - a NoteKey
    """A configured log's verifier key: a vkey of type 0x01 whose name is the log's origin."""
    from ..commit.note import ED25519, NoteKey
    from ..errors import MalformedInput

    try:
        key = NoteKey.parse(value)
    except MalformedInput as e:
        raise argparse.ArgumentTypeError(f"--log {value[:80]!r}: {e}") from None
    if key.alg != ED25519:
        raise argparse.ArgumentTypeError(f"--log {value[:80]!r}: a log's key is an Ed25519 note key (type 0x01)")
    return key


def database_url(value: str) -> str:
    """A database URL, or a SQLite file's path made one (its folder must exist)."""
    if "://" in value:
        return value
    path = Path(value).expanduser().resolve()
    if not path.parent.is_dir():
        raise ValueError(f"--db {value}: the folder {path.parent} does not exist")
    return f"sqlite:///{path}"


def port(value: str) -> int:
    """A TCP port to listen on: 0 to 65535 (0: one the system picks)."""
    n = parsed(value, int, "a port number")
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {n}")
    return n


def witness_name(value: str) -> str:
    """A witness's name: a note key name (no spaces, no plus signs, at most 255 bytes)."""
    from ..commit.note import name_problem

    problem = name_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    b = sub.add_parser("beacon", help="the online-challenge beacon")
    bs = b.add_subparsers(dest="beacon_command", required=True)
    s = bs.add_parser("serve", help="stamp the heads training runs stream with fresh, signed randomness")
    s.add_argument("--db", help=f"a SQLite file's path or a database URL (default: {DEFAULT_DB} here; "
                                "postgresql://… to scale out)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8100, help="port (default 8100)")
    s.add_argument("--per-minute", type=positive, default=1200,
                   help="requests a minute one client address may make of a worker process (default 1200, in "
                        "bursts of 200)")
    s.add_argument("--header-timeout", type=seconds, default=10.0, metavar="S",
                   help="seconds a connection may take to send a request's headers (default 10, witness.web's "
                        "HEADER_TIMEOUT); a client that trickles them is disconnected")
    s.add_argument("--workers", type=positive, default=1,
                   help="server processes (default 1; on PostgreSQL, one per core scales it out)")
    s.add_argument("--key", default=DEFAULT_BEACON_KEY,
                   help=f"the beacon's signing key (created if missing; default {DEFAULT_BEACON_KEY})")
    s.add_argument("--name", type=witness_name,
                   help="the name it cosigns checkpoints under, as a tlog-witness (default: "
                        "witness.beacon/ and the first 16 hex digits of its public key)")
    s.add_argument("--cosigner", choices=("ed25519", "ml-dsa-44"), default="ed25519",
                   help="how it cosigns checkpoints: cosignature/v1 with the beacon's Ed25519 key (default), or "
                        "tlog-cosignature's ML-DSA-44 type (0x06), which C2SP recommends for new witnesses")
    s.add_argument("--cosigner-key", default=DEFAULT_COSIGNER_KEY,
                   help=f"the ML-DSA-44 key of --cosigner ml-dsa-44 (created if missing; default {DEFAULT_COSIGNER_KEY})")
    s.add_argument("--log", type=log_vkey, action="append", default=[], metavar="VKEY",
                   help="a long-lived log to cosign, as tlog-witness configures one: its Ed25519 note vkey, named by "
                        "its origin (an operator's log holding many runs' heads; repeat for more)")
    s.set_defaults(func=cmd_beacon_serve)
