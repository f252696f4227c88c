"""Command-line parts of the leaderboard: ``witness leaderboard serve|worker|register|demo``,
``witness submit``, ``witness challenge`` and ``witness train --leaderboard``."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cli.args import parsed
from ..cli.operator import witness_at
from ..store import DEFAULT_MAX_UPLOAD
from .client_args import client_for
from .method_cli import add_method_parser

DEFAULT_STORE = "leaderboard-data"
DEFAULT_CACHE_GB = 50.0  # unpacked bundles a server's or worker's working folder keeps, with an s3:// store


def settings_from(args: argparse.Namespace):
    """Server settings from the flags shared by ``serve`` and ``worker``."""
    from .db import check_db_url
    from .service import Settings
    from .tracks import DEFAULT_TRACKS, parse_track

    work = Path(args.work) if getattr(args, "work", None) else None
    if str(args.store).startswith("s3://"):
        store: Path | str = str(args.store)
        if not args.db:
            raise ValueError("an s3:// store needs a shared database: --db postgresql://…")
        if work is None:
            raise ValueError("an s3:// store needs a local working folder: --work DIR")
        db = args.db
    else:
        store = Path(args.store)
        store.mkdir(parents=True, exist_ok=True)
        db = args.db or f"sqlite:///{store.resolve() / 'leaderboard.db'}"
    tracks = tuple(parse_track(t) for t in args.track) if args.track else DEFAULT_TRACKS
    return Settings(db_url=check_db_url(db), store=store, work=work, max_upload=args.max_upload, tracks=tracks,
                    max_head_gap=args.max_head_gap, registrations_per_hour=args.registrations_per_hour,
                    max_queued_challenges=args.max_queued_challenges,
                    server_key=Path(args.server_key) if args.server_key else None,
                    public_url=getattr(args, "public_url", None),
                    presign_endpoint=_presign(args, store), cache_bytes=_cache_bytes(args, store),
                    orphan_after_s=Settings.orphan_after_s if getattr(args, "orphan_after", None) is None
                    else args.orphan_after, witnessing=_witnessing(args))


def _witnessing(args: argparse.Namespace):  # noqa: ANN202 - a Witnessing or None
    """The operator log ``serve`` runs for witnessed tracks (``--operator-origin`` and what goes with it)."""
    from .tracks import Witnessing

    origin = getattr(args, "operator_origin", None)
    if origin is None:
        if getattr(args, "witness", None) or getattr(args, "drand", None):
            raise ValueError("--witness and --drand go with --operator-origin (the log the witnesses cosign)")
        return None
    if not args.witness or not args.drand or not args.drand_chain:
        raise ValueError("--operator-origin needs the witnesses it sends checkpoints to (--witness URL=VKEY), a drand "
                         "endpoint (--drand URL) and its chain information (--drand-chain FILE)")
    chain = json.loads(Path(args.drand_chain).read_text())
    return Witnessing(origin, tuple(args.witness), args.drand, chain, args.operator_quorum)


def _cache_bytes(args: argparse.Namespace, store: Path | str) -> int | None:
    """``--cache-gb`` in bytes for an s3:// store (its default where not given); a local store keeps all."""
    gb = getattr(args, "cache_gb", None)
    if not str(store).startswith("s3://"):
        if gb is not None:
            raise ValueError("--cache-gb needs an s3:// store (a local store's unpacked bundles are its own copy)")
        return None
    gb = DEFAULT_CACHE_GB if gb is None else gb
    if not (math.isfinite(gb) and gb >= 0):
        raise ValueError(f"--cache-gb takes a size in GB, not {gb}")
    return int(gb * 1e9)


def _presign(args: argparse.Namespace, store: Path | str) -> str | None:
    """``--presign``'s endpoint ("" for the server's own), refused without an s3:// store."""
    endpoint = getattr(args, "presign", None)
    if endpoint is not None and not str(store).startswith("s3://"):
        raise ValueError("--presign needs an s3:// store (a local store's files are served by the server)")
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--presign takes the store's address as readers reach it (http(s)://…), not {endpoint!r}")
    return endpoint


def _count(value: str) -> int:
    """A non-negative integer flag of sane size."""
    n = parsed(value, int, "an integer")
    if not 0 <= n <= 10**12:
        raise argparse.ArgumentTypeError(f"{value[:40]} is out of range")
    return n


def _workers(value: str) -> int:
    """A worker count, at most the machine's cores (each worker replays on the CPU)."""
    from ..session import cpu_cores

    n = _count(value)
    if n > cpu_cores():
        raise argparse.ArgumentTypeError(f"this machine has {cpu_cores()} core(s); start at most that many workers")
    return n


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="database URL (default: an SQLite file in the store; postgresql://… to scale out)")
    p.add_argument("--store", default=DEFAULT_STORE,
                   help="folder for uploaded bundles and plots, or s3://BUCKET[/PREFIX] for an S3-compatible object "
                        "store shared by servers and workers on many machines (endpoint and credentials from the "
                        "environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    p.add_argument("--work", metavar="DIR", help="with an s3:// store: this process's local working folder (uploads "
                                                  "being received, unpacked bundles)")
    p.add_argument("--cache-gb", type=float, metavar="GB",
                   help=f"with an s3:// store: unpacked bundles kept in --work, at most (default {DEFAULT_CACHE_GB:g}; the "
                        "least recently used go first, never one a worker of this machine is using)")
    p.add_argument("--track", action="append",
                   help="a track NAME=TASK[:KEY=VALUE,...][@METRIC+|-] (repeatable; default: the built-in tracks)")
    p.add_argument("--max-upload", type=int, default=DEFAULT_MAX_UPLOAD, help="largest accepted upload, in bytes")
    p.add_argument("--max-head-gap", type=_count, default=200,
                   help="most log records a run may leave between two streamed tree heads")
    p.add_argument("--registrations-per-hour", type=_count, default=5,
                   help="new accounts one client address may open in an hour (0 closes registration)")
    p.add_argument("--max-queued-challenges", type=_count, default=1000,
                   help="most re-challenges that may wait on one run at a time")
    p.add_argument("--server-key", help="the key the server signs its decisions with (default: server_key.pem in "
                                        "the store, created on first start)")


def run_info(args: argparse.Namespace) -> dict:
    """What ``--run-name``, ``--description`` and ``--code`` say of a run (only the flags given)."""
    given = {"title": args.run_name, "description": args.description, "code_url": args.code}
    return {k: v for k, v in given.items() if v is not None}


def run_info_flags(p: argparse.ArgumentParser) -> None:
    """The flags that describe a run on a leaderboard."""
    p.add_argument("--run-name", help="the run's name in the leaderboard's table (up to 100 characters)")
    p.add_argument("--description", help="a few words on what the run tried (up to 2,000 characters)")
    p.add_argument("--code", metavar="URL", help="a link to the run's code (http or https)")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command line of a worker process sharing the server's database and store."""
    cmd = [sys.executable, "-m", "witness.cli", "leaderboard", "worker", "--store", args.store,
           "--max-upload", str(args.max_upload), "--parent", str(os.getpid())]
    if args.work:
        cmd += ["--work", args.work]
    if args.cache_gb is not None:
        cmd += ["--cache-gb", repr(args.cache_gb)]
    if args.server_key:
        cmd += ["--server-key", args.server_key]
    if args.db:
        cmd += ["--db", args.db]
    for t in args.track or []:
        cmd += ["--track", t]
    return cmd


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the leaderboard server (and its workers)."""
    import logging

    import uvicorn

    from ..web import timed_http
    from .app import create_app
    from .recovery import recover
    from .service import Leaderboard
    from .supervise import WorkerPool

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    lb = Leaderboard(settings_from(args))
    recover(lb, lb.settings.orphan_after_s)  # before any worker: the jobs of the previous start's are free
    app = create_app(lb=lb)
    cmd = worker_command(args)
    pool = WorkerPool(lb, lambda: subprocess.Popen(cmd), args.workers)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host}, not only on loopback", file=sys.stderr)

    def _stop(signum: int, _frame: object) -> None:
        # uvicorn shuts down on SIGTERM and then raises it again with our handler restored:
        # leave through ``finally`` so the workers are stopped too.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    http=timed_http(lb.settings.header_timeout))
    finally:
        pool.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one verification worker."""
    from .service import Leaderboard
    from .worker import work

    if args.threads:
        import torch

        from ..session import bounded_threads

        torch.set_num_threads(bounded_threads(args.threads))
    lb = Leaderboard(settings_from(args), sync_tracks=False)
    # A worker started by ``serve`` stops when that server is gone, however it ended.
    orphaned = (lambda: os.getppid() != args.parent) if args.parent else None
    n = work(lb, once=args.once, stop=orphaned)
    if args.once:
        print(f"{n} job(s) done")
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    """Register this machine's signing key with a leaderboard and keep the API token."""
    from ..commit.signing import load_or_create_key, public_hex
    from .client import register, save_token

    key = load_or_create_key(Path(args.key))
    with client_for(args, need_token=False) as c:
        acct = register(c, args.name, public_hex(key.public_key()))
    path = save_token(args.leaderboard, acct["token"])
    print(f"registered {acct['name']} (account {acct['id']}); API token saved in {path}")
    return 0


def train_with_leaderboard(args: argparse.Namespace, key) -> int:  # noqa: ANN001 - Ed25519 private key
    """``witness train --leaderboard URL --track NAME``: ticket, train while streaming heads."""
    from .client import TicketedRun, train_ticketed

    if args.resume:
        raise ValueError("--resume with --leaderboard is not supported: the streamed heads pin the first try")
    with client_for(args) as c:
        # online: the leaderboard's beacon selects steps while it trains
        how = TicketedRun(checkpoint_every=args.checkpoint_every, threads=args.threads, online=True)
        info = run_info(args) | ({"method": args.method} if args.method is not None else {})
        run_id, head = train_ticketed(c, args.track, key, args.out, how, progress=not args.quiet, info=info)
    print(f"wrote {args.out}: {head.size - 2} steps, run {run_id}; submit it with "
          f"`witness submit {args.out} --leaderboard {args.leaderboard}" + (" --no-eval`" if args.method else "`"))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """Upload a finished run (evaluating it first when no certificate is given)."""
    from ..commit.signing import load_or_create_key
    from .client import describe, submit, wait, write_evaluation

    with client_for(args) as c, tempfile.TemporaryDirectory() as tmp:
        cert = args.eval
        if args.no_eval:  # a contest track scores the run itself, blind
            cert = None
        elif cert is None:
            print("no --eval certificate given: evaluating the final model now", file=sys.stderr)
            cert = write_evaluation(args.bundle, load_or_create_key(Path(args.key)), Path(tmp) / "evaluation.json",
                                    progress=not args.quiet)
        out = submit(c, args.bundle, cert)
        if run_info(args):
            describe(c, out["run_id"], run_info(args))
        print(f"submitted run {out['run_id']}: {out['status']} ({args.leaderboard.rstrip('/')}{out['url']})")
        if args.wait:
            run = wait(c, out["run_id"])
            print(f"run {out['run_id']}: {run['status']}" + (f" ({run['reason']})" if run["reason"] else ""))
            return 0 if run["status"] == "certified" else 1
    return 0


def cmd_challenge(args: argparse.Namespace) -> int:
    """Ask a leaderboard for more replay challenges on a run."""
    from .client import challenge, wait_round

    with client_for(args) as c:
        out = challenge(c, args.run_id, args.count)
        print(f"queued {out['count']} challenge(s) on run {args.run_id} (job {out['job_id']})")
        if args.wait:
            rnd = wait_round(c, args.run_id, out["job_id"], args.timeout)
            print(f"run {args.run_id}: " + ("challenges passed" if rnd["passed"] else
                                            f"challenge FAILED, certificate revoked: {rnd['detail']}"))
            return 0 if rnd["passed"] else 1
    return 0


def cmd_verify_certification(args: argparse.Namespace) -> int:
    """Check a leaderboard's signed decision offline against the server's public key."""
    import json

    from ..commit.hashing import parse_hex
    from ..commit.signing import read_public_key
    from ..evals.release import check_subject
    from .certification import check_certification, read_certification

    cert = check_certification(read_certification(args.certification), read_public_key(args.server_key))
    if args.model:
        final = cert.predicate["run"].get("final_model_hash")
        if not isinstance(final, str):
            raise ValueError("this decision names no final model (the run never got that far)")
        check_subject({"subject": cert.subjects}, args.model, parse_hex(final, "final_model_hash"))
    print(json.dumps(cert.to_json()) if args.json else cert.summary())
    return 0 if cert.accepted else 1


def cmd_check_board(args: argparse.Namespace) -> int:
    """Check a leaderboard's own history: signed by its key, rebuilt from its entries, and consistent with
    the checkpoint kept from the last check (``--keep``, then replaced by this one)."""
    from ..commit.signing import read_public_key
    from .board import fetch_and_check
    from .client import connect

    keep = Path(args.keep) if args.keep else None
    kept = keep.read_bytes() if keep is not None and keep.exists() else None
    with connect(args.leaderboard) as c:
        note, cp = fetch_and_check(c, read_public_key(args.server_key), kept)
    if keep is not None:
        keep.write_bytes(note)
    print(f"the board's history: {cp.size} entries, root {cp.root.hex()}, signed by the server"
          + (", consistent with the kept checkpoint" if kept else ""))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A fresh local leaderboard with real certified runs and one rejected run."""
    from .demo import run_demo

    return run_demo(Path(args.dir), port=args.port, serve=not args.no_serve, db=args.db, store=args.store,
                    workers=args.workers, reset=args.reset)


def add_parsers(sub: argparse._SubParsersAction, key_default: str) -> None:
    """Add ``leaderboard``, ``submit`` and ``challenge`` to the ``witness`` command."""
    lb = sub.add_parser("leaderboard", help="the leaderboard of auto-certified runs")
    lsub = lb.add_subparsers(dest="lb_command", required=True)
    s = lsub.add_parser("serve", help="run the server (loopback by default) and its verification workers")
    _server_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    s.add_argument("--public-url", help="the address people reach this server at, for absolute links such as "
                                        "badge snippets (default: the address of each request)")
    s.add_argument("--operator-origin", metavar="ORIGIN",
                   help="run an operator log for witnessed tracks (a track with witnesses=A+B): its origin, e.g. "
                        "lb.example/witness-log; its key is operator_key.pem in the store")
    s.add_argument("--witness", type=witness_at, action="append", metavar="URL=VKEY",
                   help="a witness configured for the operator log: its URL (before /add-checkpoint) and cosigner vkey")
    s.add_argument("--operator-quorum", type=int, metavar="K",
                   help="witnesses that must cosign each of the log's checkpoints (default: all)")
    s.add_argument("--drand", metavar="URL", help="the drand endpoint witnessed runs take their rounds from")
    s.add_argument("--drand-chain", metavar="FILE", help="that chain's information (its /info JSON), pinned")
    s.add_argument("--workers", type=_workers, default=1,
                   help="verification worker processes to start (at most this machine's cores; a dead one is replaced)")
    s.add_argument("--orphan-after", type=float, metavar="SECONDS",
                   help="at start, remove uploads and stored files that no committed row names once this old "
                        "(default 3600: an upload in flight on another server sharing the store is younger)")
    s.add_argument("--presign", nargs="?", const="", metavar="ENDPOINT",
                   help="with an s3:// store: downloads redirect to presigned links (good for 15 minutes) instead of "
                        "streaming through the server; ENDPOINT is the store as readers reach it (default: the "
                        "endpoint this server uses)")
    s.set_defaults(func=cmd_serve)
    w = lsub.add_parser("worker", help="run a verification worker against a server's database")
    _server_flags(w)
    w.add_argument("--once", action="store_true", help="stop when the queue is empty")
    w.add_argument("--threads", type=int, help="CPU threads for replay (at most this machine's cores)")
    w.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    w.set_defaults(func=cmd_worker)
    r = lsub.add_parser("register", help="register your signing key and keep the API token")
    r.add_argument("--leaderboard", required=True, metavar="URL", help="the leaderboard's address")
    r.add_argument("--name", required=True, help="the name your runs are listed under")
    r.add_argument("--key", default=key_default, help="the signing key to register (its public half is sent)")
    r.set_defaults(func=cmd_register)
    d = lsub.add_parser("demo", help="fill a fresh local leaderboard with real runs and serve it")
    d.add_argument("--dir", default="leaderboard-demo", help="folder for its database, store and runs (default leaderboard-demo)")
    d.add_argument("--port", type=int, default=8080, help="port to serve it on (default 8080)")
    d.add_argument("--no-serve", action="store_true", help="fill it and stop")
    d.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="the scale-out variant: the leaderboard's objects in an S3-compatible store (endpoint and "
                        "credentials from the environment), certified by worker processes; needs --db")
    d.add_argument("--db", metavar="URL", help="the scale-out variant's PostgreSQL database")
    d.add_argument("--workers", type=_workers, default=1,
                   help="the scale-out variant's worker processes (default 1, at most this machine's cores)")
    d.add_argument("--reset", action="store_true",
                   help="the scale-out variant: empty the database's tables and the store's prefix first")
    d.set_defaults(func=cmd_demo)

    sb = sub.add_parser("submit", help="upload a finished run to a leaderboard")
    sb.add_argument("bundle", help="the finished run's bundle folder")
    sb.add_argument("--leaderboard", required=True, metavar="URL", help="the leaderboard's address")
    sb.add_argument("--eval", help="its evaluation certificate (default: evaluate now)")
    sb.add_argument("--key", default=key_default, help="key that signs the evaluation when there is no --eval")
    sb.add_argument("--no-eval", action="store_true",
                    help="send no evaluation: a contest track's server scores the run itself, its targets hidden")
    sb.add_argument("--token", help="API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    sb.add_argument("--wait", action="store_true", help="wait for the verdict (exit 0 certified, 1 rejected)")
    sb.add_argument("--quiet", action="store_true", help="no progress bars")
    run_info_flags(sb)
    sb.set_defaults(func=cmd_submit)
    ch = sub.add_parser("challenge", help="ask a leaderboard for more replay challenges on a run")
    ch.add_argument("run_id", type=int, help="the run's number on the leaderboard")
    ch.add_argument("--leaderboard", required=True, metavar="URL", help="the leaderboard's address")
    ch.add_argument("--count", type=int, required=True, help="how many more challenges to ask for")
    ch.add_argument("--token", help="API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    ch.add_argument("--wait", action="store_true", help="wait for the round (exit 0 passed, 1 failed)")
    ch.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    ch.set_defaults(func=cmd_challenge)

    vc = sub.add_parser("verify-certification",
                        help="check a leaderboard's signed decision offline (0 certified, 1 not, 2 unusable)")
    vc.add_argument("certification", help="the decision file (a DSSE envelope, from the run page)")
    vc.add_argument("--server-key", required=True,
                    help="the server's public key: raw hex or PEM, or a file holding either")
    vc.add_argument("--model", help="also check that the decision names this released model file")
    vc.add_argument("--json", action="store_true", help="print the decision as one JSON object")
    vc.set_defaults(func=cmd_verify_certification)
    add_method_parser(lsub)
    cb = lsub.add_parser("check-board", help="check a leaderboard's own history: every decision an entry, none "
                                              "edited or removed since the checkpoint kept (0 holds, 1 not)")
    cb.add_argument("leaderboard", metavar="URL", help="the leaderboard's address")
    cb.add_argument("--server-key", required=True, help="the server's public key: raw hex or PEM, or a file")
    cb.add_argument("--keep", metavar="FILE", help="the checkpoint kept from the last check (replaced by this one)")
    cb.set_defaults(func=cmd_check_board)

