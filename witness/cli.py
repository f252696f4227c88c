"""The ``witness`` command line.

Exit codes of ``verify``: 0 accepted, 1 rejected, 2 unusable input.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path

from .errors import MalformedInput, RunRejected, VerificationError

DEFAULT_KEY = Path(os.environ.get("WITNESS_KEY", Path.home() / ".witness" / "signing_key.pem"))


def _hex(value: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not hex") from None


def _fraction(value: str) -> float:
    v = float(value)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError("must lie strictly between 0 and 1")
    return v


def _positive(value: str) -> int:
    v = int(value)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _config_value(text: str):
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError("use KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _trainer_r(seed: str | None) -> bytes:
    from .commit.hashing import tagged_hash

    return os.urandom(32) if seed is None else tagged_hash("witness/trainer-seed/v1", seed.encode())


def _challenge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--challenges", type=_positive, help="number of replay challenges q")
    g.add_argument("--confidence", type=_fraction, help="choose q so that detection >= C (default 0.99)")
    p.add_argument("--bad-fraction", type=_fraction, default=None, help="fraction f of bad steps to detect (default 0.05)")
    p.add_argument("--length", type=_positive, default=1, help="steps replayed per challenge (default 1)")
    p.add_argument("--nonce", type=_hex, help="the verifier's nonce (hex); random by default")


def _q(args: argparse.Namespace) -> int:
    from .verify.audit import DEFAULT_BAD_FRACTION, DEFAULT_CONFIDENCE
    from .verify.challenges import challenges_needed

    if args.challenges:
        return args.challenges
    return challenges_needed(args.confidence or DEFAULT_CONFIDENCE, args.bad_fraction or DEFAULT_BAD_FRACTION)


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a signing key."""
    from .commit.signing import generate_key, key_fingerprint, public_hex, save_key

    path = Path(args.out)
    if path.exists() and not args.force:
        print(f"{path} exists (use --force to replace it)", file=sys.stderr)
        return 2
    key = generate_key()
    pub = save_key(key, path)
    print(f"wrote {path} (private, mode 0600) and {pub}")
    print(f"public key {public_hex(key.public_key())} (fingerprint {key_fingerprint(public_hex(key.public_key()))})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a registered task with the recorder."""
    from .commit.signing import load_or_create_key
    from .record import Recorder
    from .task import build_task

    if not Path(args.key).exists():
        print(f"creating a signing key at {args.key} (its public half goes into the manifest)", file=sys.stderr)
    key = load_or_create_key(Path(args.key))
    if args.leaderboard:
        from .leaderboard.cli import train_with_leaderboard

        return train_with_leaderboard(args, key)
    if args.resume:
        rec = Recorder.resume(args.out, key, threads=args.threads)
        print(f"resuming {args.out} at step {rec.start_step}", file=sys.stderr)
    else:
        config = dict(args.config or [])
        if args.steps is not None:
            config["steps"] = args.steps
        task = build_task(args.task, config)
        rec = Recorder.create(task, args.out, key, r=_trainer_r(args.seed), checkpoint_every=args.checkpoint_every,
                              state_every=args.state_every, threads=args.threads)
    head = rec.train(progress=not args.quiet)
    print(f"wrote {args.out}: {head.size - 2} steps, final tree head {head.root.hex()}")
    return 0


def _print_verdict(verdict, args, failures: list[str] | None = None) -> None:
    if args.json:
        out = verdict.to_json() if verdict is not None else {}
        out.setdefault("accepted", False)
        if failures is not None:
            out["failures"] = failures
        for k in ("challenges", "mode", "exact", "bad_fraction", "detection_probability"):
            out.setdefault(k, None)
        print(json.dumps(out))
    elif verdict is not None:
        print(verdict.summary())


def cmd_verify(args: argparse.Namespace) -> int:
    """Audit a bundle."""
    from .verify.audit import default_response_dir, verify_bundle

    response = args.response
    if args.mode == "interactive" and response is None:
        response = default_response_dir(args.bundle)
    from .verify.replay import check_thresholds

    thresholds = dict(args.threshold or [])
    if args.rtol is not None:
        thresholds["fingerprint"] = args.rtol
    check_thresholds(thresholds)  # before any work: a bad threshold is unusable input (exit 2)
    return _report_verdict(args, lambda: verify_bundle(
        args.bundle, challenges=_q(args), bad_fraction=args.bad_fraction, nonce=args.nonce, mode=args.mode,
        response=response, exact=not args.tolerance, thresholds=thresholds, length=args.length,
        threads=args.threads, public_key=args.signer, ticket=args.ticket,
        published_heads=[_read_head(p) for p in args.published_head or []], progress=not args.json,
    ))


def _read_head(path: str):
    """A published signed tree head: a JSON file (a heads.jsonl line, or ``{"tree_head": …}``)."""
    from .commit.dsse import read_json_or_envelope
    from .commit.signing import SignedTreeHead

    obj = read_json_or_envelope(path, 1 << 20, "tree-head")
    return SignedTreeHead.from_json(obj.get("tree_head", obj) if isinstance(obj, dict) else obj)


def _report_verdict(args: argparse.Namespace, audit) -> int:
    """Run an audit and report it: exit 0 accepted, 1 rejected, 2 unusable input."""
    try:
        verdict = audit()
    except RunRejected as e:
        _print_verdict(e.verdict, args, e.failures)
        if not args.json:
            print(f"REJECTED: {e}", file=sys.stderr)
        return 1
    except VerificationError as e:
        if args.json:
            _print_verdict(None, args, [str(e)])
        if isinstance(e, MalformedInput):
            print(f"UNUSABLE INPUT: {_one_line(str(e), 1000)}", file=sys.stderr)
        else:
            print(f"REJECTED: {e}", file=sys.stderr)
        return e.exit_code
    _print_verdict(verdict, args)
    return 0


def cmd_respond(args: argparse.Namespace) -> int:
    """Answer a verifier's challenges (the trainer's side of interactive mode)."""
    from .verify.audit import default_response_dir
    from .verify.respond import respond

    if args.nonce is None:
        print("respond needs the verifier's --nonce", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_response_dir(args.bundle)
    respond(args.bundle, out, nonce=args.nonce, challenges=_q(args), length=args.length, tolerance=args.tolerance,
            progress=True)
    print(f"wrote {out}")
    return 0


INSPECT_CHECKED = ("signatures, tree heads and the log's records only; inspect neither hashes checkpoints nor "
                   "replays anything (witness verify does)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a readable summary of a bundle."""
    from .bundle.reader import open_bundle
    from .commit.signing import key_fingerprint

    b = open_bundle(args.bundle)
    m = b.manifest
    info = {
        "task": m.task,
        "steps_signed": len(b.steps),
        "steps_planned": m.steps_planned,
        "complete": b.complete,
        "signer": key_fingerprint(m.public_key),
        "public_key": m.public_key,
        "final_tree_head": b.final_head.to_json(),
        "tree_heads": len(b.heads),
        "data_root": m.data_root.hex(),
        "dataset_size": m.dataset_size,
        "run_seed": m.run_seed.hex(),
        "r_source": m.r_source,
        "checkpoints": b.checkpoint_steps(),
        "checkpoint_every": m.checkpoint_every,
        "state_every": m.state_every,
        "state_digest": m.state_digest,
        "threads": m.threads,
        "first_loss": b.steps[0].loss,
        "last_loss": b.steps[-1].loss,
        "task_config": m.task_config,
        "notes": b.notes,
        "checked": INSPECT_CHECKED,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{m.task} run, {len(b.steps)}/{m.steps_planned} steps signed ({'complete' if b.complete else 'incomplete'})")
    print(f"  signer        {info['signer']} ({m.public_key})")
    print(f"  final head    size {b.final_head.size}, root {b.final_head.root.hex()}")
    print(f"  signed at     {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(b.final_head.timestamp_ms / 1000))} UTC ({len(b.heads)} heads)")
    print(f"  data root     {m.data_root.hex()} ({m.dataset_size} samples)")
    print(f"  run seed      {m.run_seed.hex()} (r from the {m.r_source})")
    print(f"  checkpoints   {', '.join(map(str, b.checkpoint_steps()))} (every {m.checkpoint_every})")
    print(f"  state hash    {m.state_digest}, committed every {m.state_every} step(s); {m.threads} thread(s)")
    print(f"  loss          {b.steps[0].loss:.4f} -> {b.steps[-1].loss:.4f}")
    print(f"  recipe        {json.dumps(m.task_config, sort_keys=True)}")
    for n in b.notes:
        print(f"  note          {n}")
    print(f"  checked       {INSPECT_CHECKED}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train tinygpt with the recorder, verify it, write a report."""
    from .bundle.reader import open_bundle
    from .commit.signing import load_or_create_key
    from .record import Recorder
    from .report import write_report
    from .task import build_task
    from .verify.audit import verify_bundle

    out = Path(args.out)
    bundle_dir = out / "bundle"
    if bundle_dir.exists():
        if not (bundle_dir / "bundle.json").exists():
            print(f"{bundle_dir} exists and is not a bundle; choose another --out", file=sys.stderr)
            return 2
        shutil.rmtree(bundle_dir)
    key = load_or_create_key(out / "demo_key.pem")
    task = build_task("tinygpt", {"steps": args.steps})
    t0 = time.perf_counter()
    Recorder.create(task, bundle_dir, key, r=_trainer_r(None), checkpoint_every=50).train()
    train_s = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {train_s:.1f} s; now auditing with random replay challenges", file=sys.stderr)
    results = []
    try:
        verdict = verify_bundle(bundle_dir, challenges=args.challenges, progress=True)
        text, code, results = verdict.summary(), 0, verdict.results
    except RunRejected as e:
        text, code = f"REJECTED: {e}", e.exit_code
        results = getattr(e.verdict, "results", [])
    except VerificationError as e:
        text, code = f"REJECTED: {e}", e.exit_code
    print(text)
    report = write_report(open_bundle(bundle_dir), out / "report", text, [(r.step, r.passed) for r in results])
    print(f"bundle: {bundle_dir}\nreport: {report / 'report.md'} (plots: loss.png, fingerprints.png)")
    return code


def _write_proof(doc: dict, out: Path, final_state_hash: str, key_path: str) -> None:
    from .commit.dsse import envelope, statement
    from .commit.hashing import canonical_json
    from .commit.signing import load_or_create_key

    out.write_bytes(canonical_json(doc) + b"\n")
    stmt = statement("witness-final-state", final_state_hash, f"data-{doc['kind']}/v1", doc)
    env_path = out.with_name(out.name + ".dsse.json")
    env_path.write_bytes(canonical_json(envelope(stmt, load_or_create_key(Path(key_path)))) + b"\n")
    print(f"wrote {out} ({out.stat().st_size} bytes) and {env_path}")


def cmd_data(args: argparse.Namespace) -> int:
    """Data inclusion and exclusion proofs."""
    from .data.proofs import check_proof, prove_exclusion, prove_inclusion
    from .verify.data_queries import query_document, run_commitments

    if args.data_command == "check":
        return _check_data_proof(args, check_proof)
    run, task = run_commitments(args.bundle)
    document = query_document(task, args.file, args.text)
    if args.data_command == "include":
        if document not in run.usage.documents:
            print(f"document {document.hex()} was never used by this run (try: witness data exclude)", file=sys.stderr)
            return 1
        doc = prove_inclusion(run, document)
        print(f"document {document.hex()} was used in {len(doc['uses'])} step(s)")
    else:
        if document in run.usage.documents:
            print(f"document {document.hex()} WAS used by this run (try: witness data include)", file=sys.stderr)
            return 1
        doc = prove_exclusion(run, document)
        print(f"document {document.hex()} was never used by this run")
    _write_proof(doc, Path(args.out), run.end["final_state_hash"], args.key)
    return 0


def _check_data_proof(args: argparse.Namespace, check_proof) -> int:
    from .bundle.reader import open_bundle
    from .commit.dsse import read_json_or_envelope
    from .data.proofs import MAX_PROOF_BYTES

    head, key = None, None
    try:
        obj = read_json_or_envelope(args.proof, MAX_PROOF_BYTES, "proof")
        if args.bundle:
            b = open_bundle(args.bundle)
            head, key = b.final_head, b.manifest.public_key
        elif args.tree_head:
            head = _read_head(args.tree_head)
            pinned = read_json_or_envelope(args.tree_head, 1 << 20, "tree-head")
            key = pinned.get("public_key") if isinstance(pinned, dict) else None
        summary = check_proof(obj, head=head, public_key=key)
    except VerificationError as e:
        print(f"{'UNUSABLE INPUT' if isinstance(e, MalformedInput) else 'INVALID'}: {e}", file=sys.stderr)
        return e.exit_code
    if head is None:
        summary["note"] = "checked against the proof's own signed head; pin one with --bundle or --tree-head"
    print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a finished run's final model and write a signed certificate."""
    from .commit.dsse import envelope, statement
    from .commit.hashing import canonical_json
    from .commit.signing import load_or_create_key
    from .evals.evaluate import evaluate

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
    from .commit.dsse import read_json_or_envelope
    from .evals.evaluate import verify_eval

    return _report_verdict(args, lambda: verify_eval(
        read_json_or_envelope(args.cert, 256 * 1024 * 1024, "certificate"), args.bundle, spots=args.spot, forged_fraction=args.forged_fraction,
        nonce=args.nonce, exact=not args.tolerance,
    ))


def cmd_identify(args: argparse.Namespace) -> int:
    """Is a released model (weights or endpoint) the run's final model?"""
    from .evals.identity import identify

    result = identify(args.bundle, weights=args.weights, endpoint=args.endpoint, exact=not args.tolerance)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{'SAME' if result.same else 'DIFFERENT'} model ({result.method}): {result.detail}")
    return 0 if result.same else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a bundle's final model over HTTP for black-box identification."""
    from .evals.serve import make_server

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="witness", description="Certify neural-network training runs.")
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key")
    k.add_argument("--out", default=str(DEFAULT_KEY))
    k.add_argument("--force", action="store_true")
    k.set_defaults(func=cmd_keygen)

    t = sub.add_parser("train", help="train a registered task and write a witness bundle")
    t.add_argument("--task", default="tinygpt")
    t.add_argument("--steps", type=_positive)
    t.add_argument("--out", required=True)
    t.add_argument("--checkpoint-every", type=_positive, default=50)
    t.add_argument("--state-every", type=_positive, default=1,
                   help="commit the hash of the whole training state every K steps (default 1: every step)")
    t.add_argument("--seed", help="the trainer's r (any string); random by default")
    t.add_argument("--key", default=str(DEFAULT_KEY), help="signing key (created if missing)")
    t.add_argument("--threads", type=_positive, help="CPU threads (at most this machine's cores)")
    t.add_argument("--config", type=_config_value, action="append", help="recipe field KEY=VALUE")
    t.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--leaderboard", metavar="URL", help="take the run ticket from this leaderboard and stream heads to it")
    t.add_argument("--track", help="the leaderboard track (its recipe replaces --task, --steps and --config)")
    t.add_argument("--token", help="leaderboard API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("verify", help="audit a bundle (exit 0 accepted, 1 rejected, 2 unusable input)")
    v.add_argument("bundle")
    _challenge_args(v)
    v.add_argument("--mode", choices=["offline", "interactive"], default="offline")
    v.add_argument("--response", help="the trainer's response folder (interactive mode)")
    v.add_argument("--tolerance", action="store_true",
                   help="replay on other hardware: compare within reported thresholds, and the whole state at "
                        "the end of every segment, instead of bit for bit (the default)")
    v.add_argument("--rtol", type=float, help="fingerprint threshold in tolerance mode")
    v.add_argument("--threshold", type=_config_value, action="append",
                   help="tolerance-mode threshold NAME=VALUE (loss, fingerprint, sketch, update, parameters, "
                        "buffers, optimizer)")
    v.add_argument("--threads", type=_positive,
                   help="replay threads (default: the run's recorded count; at most this machine's cores)")
    v.add_argument("--ticket", type=_hex, help="the r a ticket issuer handed out for this run (hex)")
    v.add_argument("--signer", help="pin the signer's public key (hex)")
    v.add_argument("--published-head", action="append",
                   help="a tree head published earlier (JSON); the log must extend it (repeatable)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser("respond", help="answer a verifier's challenges with states and samples")
    r.add_argument("bundle")
    _challenge_args(r)
    r.add_argument("--tolerance", action="store_true",
                   help="the verifier replays in tolerance mode: also supply the state each segment ends at")
    r.add_argument("--out")
    r.set_defaults(func=cmd_respond)

    i = sub.add_parser("inspect", help="a readable summary of a bundle")
    i.add_argument("bundle")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    dq = sub.add_parser("data", help="exact data inclusion and exclusion proofs")
    dsub = dq.add_subparsers(dest="data_command", required=True)
    for name, what in (("include", "prove a document was used (exit 1 if it was not)"),
                       ("exclude", "prove a document was never used (exit 1 if it was)")):
        q = dsub.add_parser(name, help=what)
        q.add_argument("bundle")
        g = q.add_mutually_exclusive_group(required=True)
        g.add_argument("--file")
        g.add_argument("--text")
        q.add_argument("--out", required=True)
        q.add_argument("--key", default=str(DEFAULT_KEY), help="key that signs the DSSE envelope")
        q.set_defaults(func=cmd_data)
    c = dsub.add_parser("check", help="check a proof against the public commitments (0 valid, 1 invalid, 2 unusable)")
    c.add_argument("proof")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--bundle")
    g.add_argument("--tree-head", help="a published signed tree head (JSON, with public_key)")
    c.set_defaults(func=cmd_data)

    e = sub.add_parser("eval", help="evaluate the final model on the committed split; write a certificate")
    e.add_argument("bundle")
    e.add_argument("--out", required=True)
    e.add_argument("--key", default=str(DEFAULT_KEY), help="the evaluator's signing key")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)

    ve = sub.add_parser("verify-eval", help="check an evaluation certificate (exit 0 accepted, 1 rejected, 2 unusable)")
    ve.add_argument("cert")
    ve.add_argument("--bundle", required=True)
    ve.add_argument("--spot", type=_positive, default=100, help="examples to re-run (M)")
    ve.add_argument("--forged-fraction", type=_fraction, default=0.05, help="fraction g of forged results to detect")
    ve.add_argument("--nonce", type=_hex)
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

    d = sub.add_parser("demo", help="train tinygpt, verify it, and write a report")
    d.add_argument("--out", default="witness-demo")
    d.add_argument("--steps", type=_positive, default=300)
    d.add_argument("--challenges", type=_positive, default=90)
    d.set_defaults(func=cmd_demo)

    from .leaderboard.cli import add_parsers

    add_parsers(sub, str(DEFAULT_KEY))
    return p


def _one_line(text: str, limit: int = 300) -> str:
    """A message on one line of bounded length (a 5000-character path is not worth repeating)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _os_error(e: OSError) -> str:
    """An ``OSError`` as a person reads it: what went wrong, and where."""
    if e.strerror is None:
        return _one_line(str(e))
    where = e.filename if e.filename is not None else ""
    where = str(where) if len(str(where)) <= 120 else f"{str(where)[:60]}…({len(str(where))} characters)"
    full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    hint = " (out of space: free some; a training run then continues with witness train --resume)" if full else ""
    return _one_line(f"{e.strerror}{': ' + where if where else ''}{hint}")


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and bool(args.leaderboard) != bool(args.track):
        parser.error("--leaderboard and --track go together")
    try:
        return args.func(args)
    except VerificationError as e:
        print(f"{'UNUSABLE INPUT' if isinstance(e, MalformedInput) else 'REJECTED'}: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a path too long, a folder for a file, a full disk, no permission, ...
        print(f"error: {_os_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        import httpx

        from .leaderboard.client import LeaderboardError

        if isinstance(e, LeaderboardError):
            print(f"the leaderboard refused: {e}", file=sys.stderr)
            return 2
        if isinstance(e, httpx.TransportError):
            print(f"cannot reach the leaderboard: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
