"""``witness eval``, ``verify-eval``, ``identify`` and ``serve``: evaluation and identity."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .args import DEFAULT_KEY, data_arg, fraction, hex_bytes, positive
from .audit import report_verdict
from .data import released_model, unpinned_warning


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a finished run's final model and write a signed certificate."""
    from ..commit.dsse import envelope, statement
    from ..commit.hashing import canonical_json
    from ..commit.signing import load_or_create_key
    from ..evals.evaluate import evaluate

    key = load_or_create_key(Path(args.key))
    cert = evaluate(args.bundle, key, progress=not args.quiet)
    out = Path(args.out)
    subject = released_model(args.bundle, args.model, out)
    out.write_bytes(canonical_json(cert) + b"\n")
    env = envelope(statement([subject], "evaluation/v1", cert), key)
    out.with_name(out.name + ".dsse.json").write_bytes(canonical_json(env) + b"\n")
    print(f"{canonical_json(cert['aggregates']).decode()}")
    print(f"wrote {out} ({out.stat().st_size} bytes, {cert['results']['count']} examples, "
          f"{len(cert['contamination']['documents'])} evaluation documents proven absent) and {out.name}.dsse.json")
    return 0


def cmd_verify_eval(args: argparse.Namespace) -> int:
    """Check an evaluation certificate against its bundle, with spot checks."""
    from ..bundle.reader import open_bundle
    from ..commit.dsse import read_signed
    from ..commit.signing import read_public_key
    from ..errors import RunRejected
    from ..evals.evaluate import name_signer, verify_eval
    from ..evals.release import check_subject

    signer: dict = {}  # who signed what was checked, once it is known: for the WARNING after the verdict

    def audit():
        pinned = read_public_key(args.signer) if args.signer else None
        bundle = open_bundle(args.bundle)
        run_key = bundle.manifest.public_key  # the run's own key: one the verifier already trusts
        cert, signed = read_signed(args.cert, 256 * 1024 * 1024, "certificate", pinned=pinned, trusted=[run_key])

        def signed_by(verdict) -> None:  # noqa: ANN001 - an EvalVerdict
            # who made it is the certificate's evaluator (its signature on the certificate is checked), not
            # whoever wrapped it in an envelope (--signer pins both)
            signer.update(pinned=name_signer(verdict, cert, run_key, pinned), key=cert["evaluator"],
                          what="the certificate")
            if signed is not None and signed.signer != cert["evaluator"]:
                signer["carrier"] = signed.signer

        try:
            # --signer pins the evaluator too: the key that signed the certificate's body
            verdict = verify_eval(cert, bundle, spots=args.spot, forged_fraction=args.forged_fraction,
                                  nonce=args.nonce, exact=not args.tolerance, evaluator=pinned)
        except RunRejected as e:  # spot checks failed: the verdict still says who signed the certificate
            if e.verdict is not None:
                signed_by(e.verdict)
            raise
        signed_by(verdict)
        if args.model:  # after the certificate is checked: its run is this bundle, finished
            check_subject(signed.statement if signed else None, args.model, bundle.end.final_model_hash,
                          bundle.manifest.state_digest)
        return verdict

    code = report_verdict(args, audit, weak_fails=not args.allow_weak)  # fail closed on weak spot checks, as verify
    if code == 0 and not signer["pinned"]:  # an accepted certificate is what a reader may rely on
        print(unpinned_warning(signer["what"], signer["key"], "the run's key"), file=sys.stderr)
    if code == 0 and signer.get("carrier"):
        print(f"note: the certificate's envelope is signed by key {signer['carrier']}, not by its evaluator: an "
              "envelope only carries a certificate, and anyone may wrap one in an envelope of their own key",
              file=sys.stderr)
    return code


def cmd_export(args: argparse.Namespace) -> int:
    """Write the run's final model as the released safetensors file."""
    from ..bundle.reader import open_bundle
    from ..evals.release import export_model

    subject = export_model(open_bundle(args.bundle), args.out)
    print(f"wrote {args.out}: the run's final model, SHA-256 {subject['digest']['sha256']}")
    return 0


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
    from ..evals.serve import create_app
    from ..web import serve_until_interrupted, start_uvicorn

    server, thread, url = start_uvicorn(create_app(args.bundle, args.weights), args.host, args.port)
    print(f"serving {url}/v1/outputs (GET /v1/info, API at /docs); Ctrl-C stops", flush=True)
    return serve_until_interrupted(server, thread)



def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    e = sub.add_parser("eval", help="evaluate the final model on the committed split; write a certificate")
    e.add_argument("bundle", help="a finished run's bundle folder")
    e.add_argument("--out", required=True, help="the certificate file to write (a DSSE envelope goes beside it)")
    e.add_argument("--key", default=str(DEFAULT_KEY), help="the evaluator's signing key")
    e.add_argument("--model", help="the released model file the envelope names (default: model.safetensors beside "
                                   "--out, written from the run's final checkpoint if missing)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    data_arg(e)
    e.set_defaults(func=cmd_eval)

    ve = sub.add_parser("verify-eval", help="check an evaluation certificate (exit 0 accepted, 1 rejected, 2 unusable)")
    ve.add_argument("cert", help="the evaluation certificate (JSON or its DSSE envelope)")
    ve.add_argument("--bundle", required=True, help="the bundle of the run it certifies")
    ve.add_argument("--spot", type=positive, default=100, help="examples to re-run (M)")
    ve.add_argument("--forged-fraction", type=fraction, default=0.05, help="fraction g of forged results to detect")
    ve.add_argument("--nonce", type=hex_bytes, help="the verifier's nonce that picks the spot checks (hex); random by default")
    ve.add_argument("--tolerance", action="store_true", help="re-run the spot checks within thresholds (other hardware)")
    ve.add_argument("--allow-weak", action="store_true",
                    help="exit 0 for an accepted certificate whose spot checks' bound is below 90 %%, instead of 3")
    ve.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    ve.add_argument("--model", help="also check that the signed envelope names this released model file")
    ve.add_argument("--signer", help="the evaluator's key, which must have signed the certificate and its envelope: "
                                     "raw hex or PEM, or a file holding either; without it, a signer other than the "
                                     "run's own key is reported with a WARNING that nothing pins it")
    data_arg(ve)
    ve.set_defaults(func=cmd_verify_eval)

    ex = sub.add_parser("export", help="write the run's final model as a safetensors file to release")
    ex.add_argument("bundle", help="a finished run's bundle folder")
    ex.add_argument("--out", required=True, help="the .safetensors file to write")
    ex.set_defaults(func=cmd_export)

    idf = sub.add_parser("identify", help="is a released model the run's final one? (0 same, 1 different, 2 unusable)")
    idf.add_argument("bundle", help="the bundle of the run")
    g = idf.add_mutually_exclusive_group(required=True)
    g.add_argument("--weights", help="a safetensors weights file")
    g.add_argument("--endpoint", help="URL of a server that speaks the witness outputs API")
    idf.add_argument("--tolerance", action="store_true", help="accept within the calibrated threshold")
    idf.add_argument("--json", action="store_true", help="print the result as one JSON object")
    idf.set_defaults(func=cmd_identify)

    sv = sub.add_parser("serve", help="serve a bundle's final model over HTTP (loopback by default)")
    sv.add_argument("bundle", help="the bundle whose final model to serve")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    sv.add_argument("--weights", help="serve these weights instead (same architecture)")
    sv.set_defaults(func=cmd_serve)
