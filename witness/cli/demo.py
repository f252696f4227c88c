"""``witness demo``: train tinygpt, audit it three ways, certify its evaluation, and report."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from ..errors import RunRejected, VerificationError
from .args import positive, trainer_r
from .run import online_summary


def _demo_audit(audit) -> tuple[str, int, list]:
    """Run one of the demo's audits: its summary, exit code and challenge results, rejected or not."""
    try:
        verdict = audit()
        return verdict.summary(), 0, getattr(verdict, "results", [])
    except RunRejected as e:
        return f"REJECTED: {e}", e.exit_code, getattr(e.verdict, "results", [])
    except VerificationError as e:
        return f"REJECTED: {e}", e.exit_code, []


def cmd_demo(args: argparse.Namespace) -> int:
    """Train tinygpt with the recorder; audit it cheaply (the trainer answers challenges), then offline; report."""
    import os

    from ..bundle.reader import open_bundle
    from ..commit.hashing import canonical_json
    from ..commit.signing import load_or_create_key
    from ..evals.evaluate import evaluate, verify_eval
    from ..record import Commitments, Online, Recorder
    from ..report import write_report
    from ..task import build_task
    from ..verify import Evidence, Policy, Trust, Verifier
    from ..verify.respond import respond

    out = Path(args.out)
    bundle_dir = out / "bundle"
    if bundle_dir.exists():
        if not (bundle_dir / "bundle.json").exists():
            print(f"{bundle_dir} exists and is not a bundle; choose another --out", file=sys.stderr)
            return 2
        shutil.rmtree(bundle_dir)
    key = load_or_create_key(out / "demo_key.pem")
    task = build_task("tinygpt", {"steps": args.steps})
    # Online challenges that trust no single server: two witnesses of the demo's own on loopback cosign
    # each head's checkpoint, and a local drand-compatible endpoint gives each window's randomness
    # (a real run names public witnesses and the League of Entropy's quicknet).
    from ..beacon.app import create_app
    from ..beacon.drand import DrandClient, LocalDrand
    from ..beacon.drand import create_app as drand_app
    from ..beacon.windows import WitnessedLink
    from ..beacon.witness_client import WitnessClient
    from ..verify.online import WitnessTrust
    from ..web import start_uvicorn, stop_uvicorn

    local = LocalDrand(period=1)
    servers = [start_uvicorn(drand_app(local))]
    for i in (1, 2):
        (out / f"witness{i}.db").unlink(missing_ok=True)
        wkey = load_or_create_key(out / f"witness{i}_key.pem")
        servers.append(start_uvicorn(create_app(f"sqlite:///{(out / f'witness{i}.db').resolve()}", wkey,
                                                name=f"witness{i}.demo.local")))
    try:
        witnesses = [WitnessClient(url) for _, _, url in servers[1:]]
        t0 = time.perf_counter()
        rec = Recorder.create(task, bundle_dir, key, r=trainer_r(None, key), commit=Commitments(checkpoint_every=50),
                              online=Online(beacon=WitnessedLink(witnesses, DrandClient(servers[0][2], local.chain))))
        rec.train()
        train_s = time.perf_counter() - t0
    finally:
        for server, thread, _ in servers:
            stop_uvicorn(server, thread)
    url = ", ".join(u for _, _, u in servers[1:])
    print(f"randomness: a local drand-compatible endpoint at {servers[0][2]} (its own BLS key, a round a second; "
          "not the League of Entropy's quicknet, which a real run names with --drand)", file=sys.stderr)
    q = args.challenges
    print(f"\ntrained {args.steps} steps in {train_s:.1f} s, sending a checkpoint every {rec.online.spec.every} steps "
          f"to the witnesses at {url}\n{online_summary(rec.online)}\n", file=sys.stderr)

    print("1. The online audit. While the run trained, two witnesses cosigned each head's checkpoint, and the drand "
          f"round its log named, drawn after that, selected each step with p = {rec.online.spec.p:.3g}; the trainer "
          "still held those states and wrote them out. The verifier checks both witnesses' cosignatures and the "
          "round's BLS signature under the chain it pins, and replays each selected step, bit for bit.",
          file=sys.stderr)
    trust = WitnessTrust(tuple(w.key for w in witnesses), 2, local.chain)
    online_text, online_code, online_results = _demo_audit(lambda: Verifier(
        Trust(witnesses=trust), Policy(mode="online"), progress=True).verify(bundle_dir))
    print(online_text)
    r = rec.online.report()
    answer_s = r["copy_seconds"] + r["write_seconds"] + r["wait_seconds"]
    print(f"   answering cost the trainer {answer_s:.2f} s of copies and writes ({100 * answer_s / train_s:.1f}% of "
          "its training time), not a rebuilt state.\n")

    print(f"2. The cheap audit after the fact. The verifier draws {q} challenge steps from the signed log and a fresh nonce; "
          "the trainer answers with the committed states and samples (witness respond); the verifier replays "
          "each challenged step from its committed state, bit for bit.", file=sys.stderr)
    nonce = os.urandom(16)
    t0 = time.perf_counter()
    respond(bundle_dir, out / "response", nonce=nonce, challenges=q, progress=True)
    respond_s = time.perf_counter() - t0
    cheap_text, cheap_code, cheap_results = _demo_audit(lambda: Verifier(
        policy=Policy(challenges=q, nonce=nonce, mode="interactive"), progress=True).verify(
        bundle_dir, Evidence(response=out / "response")))
    print(cheap_text)
    replayed = sum(r.replayed_steps for r in cheap_results)
    print(f"   the trainer answered in {respond_s:.1f} s; the verifier replayed {replayed} of {args.steps} steps "
          f"({100 * replayed / args.steps:.1f}% of the training compute). The cost is about q steps whatever the "
          f"run's length: on a 10,000-step run the same audit replays {100 * q / 10_000:.1f}%.\n")

    print("3. The full offline audit. The verifier holds the data itself and needs nothing from the trainer; it "
          "replays every challenged segment from the nearest checkpoint, so it costs close to the training "
          "itself.", file=sys.stderr)
    text, code, results = _demo_audit(lambda: Verifier(policy=Policy(challenges=q), progress=True).verify(bundle_dir))
    print(text)
    verdicts = (f"1. online audit\n{online_text}\n\n2. cheap audit (interactive)\n{cheap_text}\n\n"
                f"3. full offline audit\n{text}")
    evaluation = None
    if not (online_code or cheap_code or code):
        print("\n4. The evaluation certificate: the final model evaluated on the committed held-out split, "
              "checked by re-running random examples.", file=sys.stderr)
        cert = evaluate(bundle_dir, key)
        (out / "evaluation.json").write_bytes(canonical_json(cert) + b"\n")
        ev_text, ev_code, _ = _demo_audit(lambda: verify_eval(cert, bundle_dir))
        print(ev_text)
        code = code or ev_code
        verdicts += f"\n\n4. evaluation certificate\n{ev_text}"
        evaluation = cert["aggregates"] if not ev_code else None
    challenged = sorted({(r.step, r.passed) for r in [*online_results, *cheap_results, *results]})
    report = write_report(open_bundle(bundle_dir), out / "report", verdicts, challenged, evaluation)
    print(f"\nbundle: {bundle_dir}\nreport: {report / 'report.md'} and {report / 'report.html'}")
    return online_code or cheap_code or code


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``witness demo``."""
    d = sub.add_parser("demo", help="train tinygpt, audit it (cheap, then offline), and write a report")
    d.add_argument("--out", default="witness-demo", help="folder for the key, bundle, response and report (default witness-demo)")
    d.add_argument("--steps", type=positive, default=300, help="tinygpt steps to train (default 300)")
    d.add_argument("--challenges", type=positive, default=90,
                   help="replay challenges q of both audits (default 90: 99%% against 5%% bad steps)")
    d.set_defaults(func=cmd_demo)
