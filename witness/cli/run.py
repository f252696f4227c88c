"""``witness keygen``, ``train``, ``inspect`` and ``demo``: the trainer's side."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from ..errors import RunRejected, VerificationError
from .args import DEFAULT_KEY, config_value, positive, trainer_r


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a signing key."""
    from ..commit.signing import generate_key, key_fingerprint, public_hex, save_key

    path = Path(args.out)
    if path.exists() and not args.force:
        print(f"{path} exists (use --force to replace it)", file=sys.stderr)
        return 2
    key = generate_key()
    pub = save_key(key, path)
    print(f"wrote {path} (private, mode 0600) and {pub}")
    print(f"public key {public_hex(key.public_key())} (fingerprint {key_fingerprint(public_hex(key.public_key()))})")
    return 0


def list_tasks() -> int:
    """Print the tasks this machine can train and verify: built in, or from installed plugins."""
    from ..task.registry import task_names, task_source

    for name in task_names():
        try:
            src = task_source(name)
        except ValueError as e:  # a broken or ambiguous plugin: say so, list the rest
            print(f"{name:24s} unusable: {e}")
            continue
        print(f"{name:24s} {'built into witness' if src is None else f'plugin {src.distribution} {src.version}'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a registered task with the recorder."""
    from ..commit.signing import load_or_create_key

    if args.task == "":
        return list_tasks()
    if not args.out:
        print("witness train: --out is required", file=sys.stderr)
        return 2
    from ..record import Recorder
    from ..task import build_task

    if not Path(args.key).exists():
        print(f"creating a signing key at {args.key} (its public half goes into the manifest)", file=sys.stderr)
    key = load_or_create_key(Path(args.key))
    if args.leaderboard:
        from ..leaderboard.cli import train_with_leaderboard

        return train_with_leaderboard(args, key)
    if args.resume:
        rec = Recorder.resume(args.out, key, threads=args.threads)
        print(f"resuming {args.out} at step {rec.start_step}", file=sys.stderr)
    else:
        config = dict(args.config or [])
        if args.steps is not None:
            config["steps"] = args.steps
        task = build_task(args.task, config)
        rec = Recorder.create(task, args.out, key, r=trainer_r(args.seed), checkpoint_every=args.checkpoint_every,
                              state_every=args.state_every, threads=args.threads)
    head = rec.train(progress=not args.quiet)
    print(f"wrote {args.out}: {head.size - 2} steps, final tree head {head.root.hex()}")
    return 0



INSPECT_CHECKED = ("signatures, tree heads and the log's records only; inspect neither hashes checkpoints nor "
                   "replays anything (witness verify does)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a readable summary of a bundle."""
    from ..bundle.reader import open_bundle
    from ..commit.signing import key_fingerprint

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
    from ..bundle.reader import open_bundle
    from ..commit.signing import load_or_create_key
    from ..record import Recorder
    from ..report import write_report
    from ..task import build_task
    from ..verify.audit import verify_bundle

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
    Recorder.create(task, bundle_dir, key, r=trainer_r(None), checkpoint_every=50).train()
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



def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    k = sub.add_parser("keygen", help="create an Ed25519 signing key")
    k.add_argument("--out", default=str(DEFAULT_KEY))
    k.add_argument("--force", action="store_true")
    k.set_defaults(func=cmd_keygen)

    t = sub.add_parser("train", help="train a registered task and write a witness bundle")
    t.add_argument("--task", nargs="?", const="", default="tinygpt",
                   help="the task to train (default tinygpt); --task alone lists the tasks installed here")
    t.add_argument("--steps", type=positive)
    t.add_argument("--out", help="the bundle folder to write (required to train)")
    t.add_argument("--checkpoint-every", type=positive, default=50)
    t.add_argument("--state-every", type=positive, default=1,
                   help="commit the hash of the whole training state every K steps (default 1: every step)")
    t.add_argument("--seed", help="the trainer's r (any string); random by default")
    t.add_argument("--key", default=str(DEFAULT_KEY), help="signing key (created if missing)")
    t.add_argument("--threads", type=positive, help="CPU threads (at most this machine's cores)")
    t.add_argument("--config", type=config_value, action="append", help="recipe field KEY=VALUE")
    t.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--leaderboard", metavar="URL", help="take the run ticket from this leaderboard and stream heads to it")
    t.add_argument("--track", help="the leaderboard track (its recipe replaces --task, --steps and --config)")
    t.add_argument("--token", help="leaderboard API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    t.set_defaults(func=cmd_train)

    i = sub.add_parser("inspect", help="a readable summary of a bundle")
    i.add_argument("bundle")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("demo", help="train tinygpt, verify it, and write a report")
    d.add_argument("--out", default="witness-demo")
    d.add_argument("--steps", type=positive, default=300)
    d.add_argument("--challenges", type=positive, default=90)
    d.set_defaults(func=cmd_demo)
