"""``witness keygen``, ``train``, ``inspect`` and ``demo``: the trainer's side."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .args import (
    DEFAULT_KEY,
    chunk_count,
    config_value,
    data_arg,
    memory,
    positive,
    probability,
    seconds,
    share,
    trainer_r,
)

SELF_CHECK_SHARE = 0.01  # witness.record.options.DEFAULT_SHARE (imported here, it would import torch)
ONLINE_CHUNKS = 2  # witness.record.link.DEFAULT_CHUNKS (the same: its help says the default)


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
    from ..record import Commitments, Online, Recorder, SelfChecking, Training
    from ..task import build_task

    if not Path(args.key).exists():
        print(f"creating a signing key at {args.key} (its public half goes into the manifest)", file=sys.stderr)
    key = load_or_create_key(Path(args.key))
    if args.leaderboard:
        from ..leaderboard.cli import train_with_leaderboard

        return train_with_leaderboard(args, key)
    beacon = _beacon(args)
    if args.resume:
        rec = Recorder.resume(args.out, key, threads=args.threads, online=Online(beacon=beacon),
                              self_check=SelfChecking(enabled=not args.no_self_check, share=args.self_check_share))
        print(f"resuming {args.out} at step {rec.start_step}", file=sys.stderr)
    else:
        config = dict(args.config or [])
        if args.preset:
            from ..task.tinygpt import PRESETS

            if args.task != "tinygpt":
                raise ValueError("--preset names a tinygpt size; use it with --task tinygpt")
            config = PRESETS[args.preset] | config  # --config overrides a preset's field
        if args.steps is not None:
            config["steps"] = args.steps
        task = build_task(args.task, config)
        rec = Recorder.create(task, args.out, key, r=trainer_r(args.seed, key),
                              commit=Commitments(checkpoint_every=args.checkpoint_every, state_every=args.state_every),
                              training=Training(threads=args.threads, device=args.device),
                              online=Online(beacon=beacon,
                                            spec=_online_spec(args, task.config.steps, beacon) if beacon else None,
                                            ring_bytes=args.online_ring_memory),
                              self_check=SelfChecking(enabled=not args.no_self_check, share=args.self_check_share))
    head = rec.train(progress=not args.quiet)
    print(f"wrote {args.out}: {head.size - 2} steps, final tree head {head.root.hex()}")
    hint = rec.cost()["hint"]
    if hint:
        print(f"note: {hint}", file=sys.stderr)
    if rec.online is not None:
        print(online_summary(rec.online), file=sys.stderr)
    return 0


def _beacon(args: argparse.Namespace):
    """The beacon client ``--beacon`` names (its key pinned with ``--beacon-key``), or None."""
    if args.witness or args.drand or args.operator:
        if args.beacon is not None or args.beacon_key:
            raise ValueError("online challenges come from one beacon (--beacon URL) or from witnesses and drand "
                             "(--witness URL or --operator URL, with --drand URL), not both")
        return _witnessed(args)
    if args.beacon is None:
        if args.beacon_key or args.online_p or args.online_every or args.online_chunks is not None \
                or args.online_ring_memory is not None:
            raise ValueError("--beacon-key, --online-p, --online-every, --online-chunks and --online-ring-memory go "
                             "with --beacon URL (or --witness URL)")
        return None
    if not args.beacon.strip():
        raise ValueError("--beacon names no beacon (an empty URL): give its URL, or leave --beacon out")
    from ..beacon.client import BeaconClient
    from ..commit.signing import read_public_key

    return BeaconClient(args.beacon, read_public_key(args.beacon_key) if args.beacon_key else None,
                        patience=args.beacon_patience)


def _witnessed(args: argparse.Namespace):  # noqa: ANN202 - a WitnessedLink
    """The witnesses ``--witness`` names and the drand endpoint ``--drand`` names, its chain pinned."""
    if not (args.witness or args.operator) or not args.drand or (args.witness and args.operator):
        raise ValueError("witnessed online challenges need --drand URL and either --witness URL (repeatable: the "
                         "run's own log) or --operator URL (an operator's log the witnesses are configured for)")
    from ..beacon.drand import DrandClient
    from ..beacon.windows import WitnessedLink
    from ..beacon.witness_client import WitnessClient
    from ..commit.drand import chain_info

    drand = DrandClient(args.drand, chain_info(args.drand_chain))
    drand.info()  # the endpoint serves the pinned chain, or training does not start
    if args.operator:
        from ..beacon.operator_link import OperatorClient, OperatorLink

        return OperatorLink(OperatorClient(args.operator, patience=args.beacon_patience), drand)
    return WitnessedLink([WitnessClient(u, patience=args.beacon_patience) for u in args.witness], drand)


def _online_spec(args: argparse.Namespace, steps: int, beacon=None):  # noqa: ANN001 - a BeaconLink
    from ..record.link import OnlineSpec

    chain = getattr(beacon, "chain", None)
    return OnlineSpec.for_steps(steps, **({"every": args.online_every} if args.online_every else {}), p=args.online_p,
                                drand=chain.hash.hex() if chain is not None else None, chunks=args.online_chunks)


def online_summary(online) -> str:
    """What answering the beacon cost the trainer, in a line."""
    r = online.report()
    what = "witnessed window(s)" if hasattr(online.link, "settle") else "beacon statement(s)"
    return (f"online challenges: {r['statements']} {what} selected {r['selected']} step(s); kept "
            f"{r['written']} state(s) ({r['bytes_written'] / 1e6:.1f} MB), at most {r['peak_ring']} in the ring; "
            f"training waited for the beacon {r['waits']} time(s) ({r['wait_seconds']:.2f} s)"
            + (f"; every step's chunks opened in {r['opened']} window(s) ({r['opened_bytes'] / 1e6:.1f} MB)"
               if r["opened"] else "")
            + (f"; {r['rebuilt']} lost state(s) rebuilt from a checkpoint" if r["rebuilt"] else ""))



INSPECT_CHECKED = ("signatures, tree heads and the log's records only; inspect neither hashes checkpoints nor "
                   "replays anything (witness verify does)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a readable summary of a bundle."""
    from ..bundle.reader import open_bundle
    from ..commit.signing import key_fingerprint
    from ..session import describe_device

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
        "device": m.device,
        "first_loss": b.steps[0].loss,
        "last_loss": b.steps[-1].loss,
        "task_config": m.task_config,
        "notes": b.notes,
        "checked": INSPECT_CHECKED,
        "online": _online_info(b),
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
    print(f"  hardware      {describe_device(m.device)}; torch {m.torch_version}")
    print(f"  loss          {b.steps[0].loss:.4f} -> {b.steps[-1].loss:.4f}")
    print(f"  recipe        {json.dumps(m.task_config, sort_keys=True)}")
    if info["online"] is not None:
        o = info["online"]
        what = "witnessed window(s)" if o["witnessed"] else "beacon statement(s)"
        chain = (f"{o['statements']} {what} over steps 0..{o['covered'] - 1}" if o["statements"]
                 else "no beacon statement")
        print(f"  online        p = {o['p']:g}, a head every {o['every']} steps, a ring of {o['ring']} states; {chain}, "
              f"{len(o['selected'])} step(s) selected, {o['states_kept']} state(s) kept"
              + (f"; every step's move: {o['chunks']} chunk(s) of {o['chunk_bytes']} bytes opened per state, "
                 f"{o['chunks_kept']} window(s) opened" if "chunks" in o else "")
              + (f"; missing {o['missing']}" if o["missing"] else "")
              + (" (signatures unchecked: witness verify --mode online --witness NAME=KEY … --drand quicknet checks "
                 "them)" if o["witnessed"] else
                 " (signatures unchecked: witness verify --mode online --beacon-key KEY checks them)"))
    for n in b.notes:
        print(f"  note          {n}")
    print(f"  checked       {INSPECT_CHECKED}")
    return 0


def _online_info(b) -> dict | None:  # noqa: ANN001 - a Bundle
    """The online audit's state as the bundle holds it (the statements parsed, not their signatures checked)."""
    m = b.manifest
    if m.online is None:
        return None
    from ..commit.window import WitnessedWindow
    from ..verify.online import parse_statements, selected_by

    sts = sorted(parse_statements(b), key=lambda s: s.size)
    n = len(b.steps)
    selected = selected_by(sts, m.online["p"], n)
    whole = {t for t, shares in b.online_shards.items() if len(shares) == m.world_size}  # every rank's share kept
    missing = [t for t in selected if t not in b.online_states and t not in whole or t not in b.online_samples]
    return dict(m.online, statements=len(sts), covered=sts[-1].window(n).stop if sts else 0, selected=selected,
                states_kept=len(b.online_states) + len(whole), missing=missing, chunks_kept=len(b.online_chunks),
                beacons=sorted({getattr(st, "beacon", "witnesses") for st in sts}), final=bool(sts) and sts[-1].final,
                witnessed=any(isinstance(st, WitnessedWindow) for st in sts))


def cmd_report(args: argparse.Namespace) -> int:
    """Write a bundle's report (markdown and HTML with plots), with a checked evaluation if given."""
    from ..bundle.reader import open_bundle
    from ..report import write_report

    bundle = open_bundle(args.bundle)
    evaluation, verdict_text, challenged, rejected = None, "", None, False
    if not args.no_verify:  # the report shows the run's verdict: the offline audit at verify's defaults
        from ..errors import RunRejected
        from ..verify import Policy, Verifier

        try:
            verdict = Verifier(policy=Policy()).verify(bundle)
        except RunRejected as e:
            if e.verdict is None:
                raise
            verdict, rejected = e.verdict, True
        verdict_text, challenged = verdict.summary(), [(r.step, r.passed) for r in verdict.results]
    if args.eval:
        from ..commit.dsse import read_json_or_envelope
        from ..evals.evaluate import name_signer, verify_eval
        from .data import unpinned_warning

        # Only a certificate that passes verify-eval's checks (and its spot checks) reaches the report.
        cert = read_json_or_envelope(args.eval, 256 * 1024 * 1024, "certificate")
        ev = verify_eval(cert, bundle, spots=args.spot)
        if not name_signer(ev, cert, bundle.manifest.public_key):  # the report names who made it, as verify-eval
            print(unpinned_warning("the certificate", ev.signer_key, "the run's key"), file=sys.stderr)
        evaluation, verdict_text = ev.aggregates, "\n\n".join(filter(None, [verdict_text, ev.summary()]))
    out = write_report(bundle, args.out, verdict_text, challenged, evaluation=evaluation)
    print(f"wrote {out / 'report.md'} and {out / 'report.html'}" + (" (the run is REJECTED: see its verdict)"
                                                                    if rejected else ""))
    return 1 if rejected else 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    k = sub.add_parser("keygen", help="create an Ed25519 signing key")
    k.add_argument("--out", default=str(DEFAULT_KEY), help="where to write the private key (its public half goes beside it as .pub)")
    k.add_argument("--force", action="store_true", help="replace an existing key (runs signed with it stay verifiable only by its public key)")
    k.set_defaults(func=cmd_keygen)

    t = sub.add_parser("train", help="train a registered task and write a witness bundle")
    t.add_argument("--task", nargs="?", const="", default="tinygpt",
                   help="the task to train (default tinygpt); --task alone lists the tasks installed here")
    t.add_argument("--steps", type=positive, help="optimizer steps to train (default: the recipe's)")
    t.add_argument("--out", help="the bundle folder to write (required to train)")
    t.add_argument("--checkpoint-every", type=positive, default=50,
                   help="keep a full checkpoint every N steps (default 50; a multiple of --state-every)")
    t.add_argument("--no-self-check", action="store_true",
                   help="skip the record-time self-check (step 0 and one random later step replayed as a "
                        "verifier will, stopping at once if the bits differ; later steps sampled in the "
                        "background)")
    t.add_argument("--self-check-share", type=share, default=SELF_CHECK_SHARE, metavar="FRACTION",
                   help="what the background self-check may cost, as a fraction of the training steps' time "
                        f"(default {SELF_CHECK_SHARE:g}; 0 turns it off): sampled later steps replayed by a checker "
                        "process, the run stopped before its next tree head if one does not replay")
    t.add_argument("--state-every", type=positive, default=1,
                   help="commit the hash of the whole training state every K steps (default 1: every step)")
    t.add_argument("--seed", help="a text that, with the signing key, gives the trainer's r (the same text and key, the "
                                  "same run seed; no one without the key can guess it); random by default")
    t.add_argument("--key", default=str(DEFAULT_KEY), help="signing key (created if missing)")
    t.add_argument("--threads", type=positive, help="CPU threads (at most this machine's cores)")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="train on the CPU (default) or the GPU, with deterministic kernels; the manifest records "
                        "the hardware, and exact replay needs the same")
    t.add_argument("--config", type=config_value, action="append", help="recipe field KEY=VALUE")
    t.add_argument("--preset", choices=["gpt2-small", "1b"],
                   help="tinygpt at the method's scale, for a GPU: GPT-2 small's body (86 M parameters) or 1.2 B, "
                        "bf16 autocast, 65,536 tokens per step")
    t.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--beacon", metavar="URL", help="take online challenges: stream a head to this beacon every "
                                                   "--online-every steps and keep the states it selects")
    t.add_argument("--beacon-patience", type=seconds, default=600.0, metavar="SECONDS",
                   help="how long a request to the beacon is tried again before training stops (default 600; "
                        "training goes on meanwhile until its ring of kept states is full)")
    t.add_argument("--beacon-key", help="pin the beacon's public key (raw hex or PEM, or a file holding either)")
    t.add_argument("--witness", action="append", metavar="URL",
                   help="take online challenges from witnesses and drand instead of one beacon: each head goes, as "
                        "a C2SP checkpoint, to this transparency-log witness (repeatable; with --drand)")
    t.add_argument("--operator", metavar="URL",
                   help="take witnessed online challenges through an operator's log (witness operator serve): each "
                        "head becomes an entry of that one long-lived log, whose checkpoints its witnesses cosign "
                        "(with --drand; instead of --witness)")
    t.add_argument("--drand", metavar="URL", help="with --witness or --operator: the drand HTTP endpoint each window's "
                                                  "round comes from (https://api.drand.sh for the League of Entropy's)")
    t.add_argument("--drand-chain", default="quicknet", metavar="quicknet|CHAIN-INFO.json",
                   help="the drand chain the endpoint must serve (default quicknet, pinned here)")
    t.add_argument("--online-p", type=probability,
                   help="the probability a beacon selects each step (default: enough for 99%% against 5%% bad steps)")
    t.add_argument("--online-every", type=positive, help="steps between heads streamed to the beacon (default 10)")
    t.add_argument("--online-chunks", type=chunk_count, metavar="K",
                   help="parameter chunks each window opens of every state, for the bounded-move check of every step "
                        f"(default {ONLINE_CHUNKS}; 0 commits none)")
    t.add_argument("--online-ring-memory", type=memory, metavar="SIZE",
                   help="the most host memory the ring of kept states may take (bytes, or 8GiB, 512MiB; default a "
                        "quarter of this host's, shared by its ranks): a run whose window does not fit is refused "
                        "before step 0")
    t.add_argument("--leaderboard", metavar="URL", help="take the run ticket from this leaderboard and stream heads to it")
    t.add_argument("--track", help="the leaderboard track (its recipe replaces --task, --steps and --config)")
    t.add_argument("--method", type=int, metavar="N",
                   help="on a contest track: your method N (`witness leaderboard method`), whose wheel is installed here")
    t.add_argument("--token", help="leaderboard API token (default: $WITNESS_LEADERBOARD_TOKEN or the saved one)")
    from ..leaderboard.cli import run_info_flags

    run_info_flags(t)
    data_arg(t)
    t.set_defaults(func=cmd_train)

    i = sub.add_parser("inspect", help="a readable summary of a bundle")
    i.add_argument("bundle", help="the bundle folder")
    i.add_argument("--json", action="store_true", help="print one JSON object for a machine")
    i.set_defaults(func=cmd_inspect)

    rp = sub.add_parser("report", help="write a bundle's report: markdown and HTML with plots")
    rp.add_argument("bundle", help="the bundle folder")
    rp.add_argument("--out", required=True, help="the folder to write report.md, report.html and the plots into")
    rp.add_argument("--eval", help="an evaluation certificate of the run: checked, then its metrics are plotted")
    rp.add_argument("--spot", type=positive, default=100, help="examples the certificate's check re-runs (default 100)")
    rp.add_argument("--no-verify", action="store_true",
                    help="leave the run's verdict out (by default the offline audit runs, as witness verify does with "
                         "its defaults, and the report shows its verdict; exit 1 if it rejects the run)")
    rp.set_defaults(func=cmd_report)

