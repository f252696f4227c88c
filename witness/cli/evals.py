"""``witness eval``, ``verify-eval``, ``identify`` and ``serve``: evaluation and identity."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .args import DEFAULT_KEY, fraction, hex_bytes, positive
from .audit import report_verdict


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a finished run's final model and write a signed certificate."""
    from ..commit.dsse import envelope, statement
    from ..commit.hashing import canonical_json
    from ..commit.signing import load_or_create_key
    from ..evals.evaluate import evaluate

    key = load_or_create_key(Path(args.key))
    cert = evaluate(args.bundle, key, progress=not args.quiet)
    out = Path(args.out)
    out.write_bytes(canonical_json(cert) + b"\n")
    final = cert["run"]["tree_head"]["extensions"]["final_state_hash"]
    env = envelope(statement("witness-final-state", final, "evaluation/v1", cert), key)
    out.with_name(out.name + ".dsse.json").write_bytes(canonical_json(env) + b"\n")
    print(f"{canonical_json(cert['aggregates']).decode()}")
    print(f"wrote {out} ({out.stat().st_size} bytes, {cert['results']['count']} examples, "
          f"{len(cert['contamination']['documents'])} evaluation documents proven absent) and {out.name}.dsse.json")
    return 0


def cmd_verify_eval(args: argparse.Namespace) -> int:
    """Check an evaluation certificate against its bundle, with spot checks."""
    from ..commit.dsse import read_json_or_envelope
    from ..evals.evaluate import verify_eval

    return report_verdict(args, lambda: verify_eval(
        read_json_or_envelope(args.cert, 256 * 1024 * 1024, "certificate"), args.bundle, spots=args.spot, forged_fraction=args.forged_fraction,
        nonce=args.nonce, exact=not args.tolerance,
    ))


def cmd_identify(args: argparse.Namespace) -> int:
    """Is a released model (weights or endpoint) the run's final model?"""
    from ..evals.identity import identify

    result = identify(args.bundle, weights=args.weights, endpoint=args.endpoint, exact=not args.tolerance)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{'SAME' if result.same else 'DIFFERENT'} model ({result.method}): {result.detail}")
    return 0 if result.same else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a bundle's final model over HTTP for black-box identification."""
    from ..evals.serve import make_server

    server = make_server(args.bundle, args.host, args.port, args.weights)
    host, port = server.server_address[:2]
    print(f"serving http://{host}:{port}/v1/outputs (GET /v1/info); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0



def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    e = sub.add_parser("eval", help="evaluate the final model on the committed split; write a certificate")
    e.add_argument("bundle")
    e.add_argument("--out", required=True)
    e.add_argument("--key", default=str(DEFAULT_KEY), help="the evaluator's signing key")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)

    ve = sub.add_parser("verify-eval", help="check an evaluation certificate (exit 0 accepted, 1 rejected, 2 unusable)")
    ve.add_argument("cert")
    ve.add_argument("--bundle", required=True)
    ve.add_argument("--spot", type=positive, default=100, help="examples to re-run (M)")
    ve.add_argument("--forged-fraction", type=fraction, default=0.05, help="fraction g of forged results to detect")
    ve.add_argument("--nonce", type=hex_bytes)
    ve.add_argument("--tolerance", action="store_true")
    ve.add_argument("--json", action="store_true")
    ve.set_defaults(func=cmd_verify_eval)

    idf = sub.add_parser("identify", help="is a released model the run's final one? (0 same, 1 different, 2 unusable)")
    idf.add_argument("bundle")
    g = idf.add_mutually_exclusive_group(required=True)
    g.add_argument("--weights", help="a safetensors weights file")
    g.add_argument("--endpoint", help="URL of a server that speaks the witness outputs API")
    idf.add_argument("--tolerance", action="store_true", help="accept within the calibrated threshold")
    idf.add_argument("--json", action="store_true")
    idf.set_defaults(func=cmd_identify)

    sv = sub.add_parser("serve", help="serve a bundle's final model over HTTP (loopback by default)")
    sv.add_argument("bundle")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--weights", help="serve these weights instead (same architecture)")
    sv.set_defaults(func=cmd_serve)
