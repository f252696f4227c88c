"""``witness verify`` and ``respond``: the interactive and offline audit."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..errors import RunRejected, VerificationError
from ..verify.verdict import percent_down
from .args import (
    challenge_args,
    challenges_q,
    config_value,
    data_arg,
    digest_hex,
    hex_bytes,
    positive,
    unusable_or_rejected,
)


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


def _method(path: str | None):  # noqa: ANN202 - a MethodWheel or None
    """The submitted method's wheel (``--method``), read strictly; never imported here."""
    if path is None:
        return None
    from ..errors import MalformedInput
    from ..methods.wheel import MAX_WHEEL_BYTES, read_wheel

    with open(path, "rb") as f:
        data = f.read(MAX_WHEEL_BYTES + 1)
    if len(data) > MAX_WHEEL_BYTES:
        raise MalformedInput(f"{path} is over the {MAX_WHEEL_BYTES} bytes a method's wheel may be")
    return read_wheel(data)


def cmd_verify(args: argparse.Namespace) -> int:
    """Audit a bundle."""
    from ..commit.signing import read_public_key
    from ..verify import Evidence, Policy, Trust, Verifier
    from ..verify.audit import default_response_dir

    response = args.response
    if args.mode == "interactive" and response is None:
        response = default_response_dir(args.bundle)
    from ..verify.replay import check_thresholds

    thresholds = dict(args.threshold or [])
    if args.rtol is not None:
        thresholds["fingerprint"] = args.rtol
    check_thresholds(thresholds)  # before any work: a bad threshold is unusable input (exit 2)
    beacon_key = witnesses = None
    if args.mode == "online":
        if args.witness or args.drand:
            witnesses = _witness_trust(args)
            if args.beacon_key:
                print("witness verify: trust one beacon (--beacon-key) or witnesses and drand (--witness, --drand), "
                      "not both", file=sys.stderr)
                return 2
        elif not args.beacon_key:
            print("witness verify --mode online needs whom you trust: --witness NAME=KEY (repeatable) with --drand "
                  "quicknet, or --beacon-key for one beacon (a beacon the bundle names, or the trainer runs, proves "
                  "nothing)", file=sys.stderr)
            return 2
        else:
            beacon_key = read_public_key(args.beacon_key)
    elif args.beacon_key or args.witness or args.drand or args.witnesses_required or args.operator:
        print("--beacon-key, --witness, --witnesses-required, --operator and --drand are for --mode online",
              file=sys.stderr)
        return 2

    def audit():  # noqa: ANN202 - a Verdict; built here, so an unusable flag is exit 2 with the rest
        trust = Trust(signer=read_public_key(args.signer) if args.signer else None, beacon_key=beacon_key,
                      witnesses=witnesses, published_heads=[read_head(p) for p in args.published_head or []],
                      ticket=args.ticket, data_root=args.data_root, method=_method(args.method))
        policy = Policy(mode=args.mode, challenges=challenges_q(args), confidence=args.confidence,
                        bad_fraction=args.bad_fraction, length=args.length, exact=not args.tolerance,
                        thresholds=thresholds, threads=args.threads, device=args.device, nonce=args.nonce)
        return Verifier(trust, policy, progress=not args.json).verify(args.bundle, Evidence(response, args.leaves))

    return report_verdict(args, audit, weak_fails=not args.allow_weak)


_VKEY = re.compile(r"[^+\s]+\+[0-9a-f]{8}\+")  # a vkey's name and key ID (a name may hold "=")


def witness_key(value: str):  # noqa: ANN201 - a NoteKey
    """``NAME=KEY`` (KEY: 64 hex digits, or base64 of 0x04 and the key) or a whole vkey ``NAME+ID+BASE64``
    (an ML-DSA-44 witness's, type 0x06, is given as its vkey)."""
    from ..commit.note import COSIGNATURE_V1, COSIGNER_TYPES, NoteKey, b64decode
    from ..errors import MalformedInput

    try:
        if not _VKEY.match(value) and ("=" in value.split("+", 1)[0] or ("=" in value and "+" not in value)):
            name, key = value.split("=", 1)
            if len(key) == 64 and all(c in "0123456789abcdefABCDEF" for c in key):
                raw = bytes.fromhex(key)
            else:
                raw = b64decode(key, "witness key")
                if len(raw) == 33 and raw[0] == COSIGNATURE_V1:
                    raw = raw[1:]
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

            return NoteKey.of(name, Ed25519PublicKey.from_public_bytes(raw), COSIGNATURE_V1)
        k = NoteKey.parse(value)
    except (MalformedInput, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{value[:80]!r} is not NAME=KEY (KEY: 64 hex digits) or a witness vkey: "
                                         f"{e}") from None
    if k.alg not in COSIGNER_TYPES:
        raise argparse.ArgumentTypeError(f"{k.name}'s vkey is of signature type {k.alg:#04x}, not a cosigner key "
                                         "(cosignature/v1, 0x04, or ML-DSA-44, 0x06)")
    return k


def _witness_trust(args: argparse.Namespace):  # noqa: ANN202 - a WitnessTrust
    """The witnesses and drand chain ``--witness``, ``--witnesses-required`` and ``--drand`` name."""
    from ..commit.drand import chain_info
    from ..errors import MalformedInput
    from ..verify.online import WitnessTrust

    if not args.witness or not args.drand:
        raise MalformedInput("witnessed online mode needs both --witness NAME=KEY (repeatable) and --drand "
                             "quicknet|CHAIN-INFO.json")
    # a majority by default: any two sets of K > N/2 share a witness, which refuses a second branch
    required = args.witnesses_required or len(args.witness) // 2 + 1
    return WitnessTrust(tuple(args.witness), required, chain_info(args.drand), _operator_trust(args))


def _operator_trust(args: argparse.Namespace):  # noqa: ANN202 - an OperatorTrust or None
    """The operator log ``--operator VKEY`` pins, its entries read at ``--operator-url``."""
    from ..commit.note import NoteKey
    from ..errors import MalformedInput
    from ..verify.operator import OperatorTrust

    if args.operator is None:
        if args.operator_url:
            raise MalformedInput("--operator-url reads the entries of the log --operator VKEY pins: give both")
        return None
    entries = None
    if args.operator_url:
        from ..beacon.operator_link import OperatorClient

        client = OperatorClient(args.operator_url, vkey=args.operator)
        entries = client.entries
    return OperatorTrust(NoteKey.parse(args.operator), entries)


def read_head(path: str):
    """A published signed tree head: a JSON file (a heads.jsonl line, or ``{"tree_head": …}``)."""
    from ..commit.dsse import read_json_or_envelope
    from ..commit.signing import SignedTreeHead

    obj = read_json_or_envelope(path, 1 << 20, "tree-head")
    return SignedTreeHead.from_json(obj.get("tree_head", obj) if isinstance(obj, dict) else obj)


EXIT_WEAK = 3  # accepted, but its bound falls short of the confidence asked for (90 % when none was)


def report_verdict(args: argparse.Namespace, audit, weak_fails: bool = False) -> int:
    """Run an audit and report it: exit 0 accepted, 1 rejected, 2 unusable input; with
    ``weak_fails``, 3 for an accepted audit whose bound falls short (fail closed: a script that
    checks only the exit code never takes a weak audit for a certificate)."""
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
        print(unusable_or_rejected(e), file=sys.stderr)
        return e.exit_code
    _print_verdict(verdict, args)
    if weak_fails and getattr(verdict, "outcome", "accepted") == "weak":
        print(f"WEAK: accepted, but the bound {percent_down(verdict.detection_probability)}% is below the "
              f"{100 * verdict.floor:g}% this audit must reach (exit {EXIT_WEAK}; --allow-weak accepts it)",
              file=sys.stderr)
        return EXIT_WEAK
    return 0


def cmd_respond(args: argparse.Namespace) -> int:
    """Answer a verifier's challenges (the trainer's side of interactive mode)."""
    from ..verify.audit import default_response_dir
    from ..verify.respond import respond

    if args.nonce is None:
        print("respond needs the verifier's --nonce", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_response_dir(args.bundle)
    respond(args.bundle, out, nonce=args.nonce, challenges=challenges_q(args), length=args.length, tolerance=args.tolerance,
            progress=True, device=args.device)
    print(f"wrote {out}")
    return 0



def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    v = sub.add_parser("verify", help="audit a bundle (exit 0 accepted, 1 rejected, 2 unusable input, 3 accepted "
                                      "with a bound below the confidence asked for)")
    v.add_argument("bundle", help="the bundle folder")
    challenge_args(v)
    v.add_argument("--allow-weak", action="store_true",
                   help="exit 0 for an accepted audit whose bound is below the confidence asked for (90 %% when "
                        "none was), instead of 3")
    v.add_argument("--data-root", type=digest_hex,
                   help="the data root (hex) the run must have trained on: compared with the manifest's, cheaply")
    v.add_argument("--mode", choices=["offline", "interactive", "online"], default="offline",
                   help="offline: replay from the bundle's checkpoints with the data here (default); interactive: "
                        "the cheap audit, from the states and samples in the trainer's --response; online: replay "
                        "the steps a beacon selected while the run trained (needs --beacon-key)")
    v.add_argument("--beacon-key", help="online mode: the public key of the beacon you trust (raw hex or PEM, or a "
                                        "file holding either; the leaderboard's server key for its beacon)")
    v.add_argument("--witness", action="append", metavar="NAME=KEY", type=witness_key,
                   help="online mode: a transparency-log witness you trust to cosign each window: its name and "
                        "Ed25519 key (hex, or its vkey NAME+ID+BASE64); repeatable")
    v.add_argument("--witnesses-required", type=positive, metavar="K",
                   help="how many of the --witness keys must cosign each window (default: more than half of "
                        "them; with K <= N/2 the bound is taken over N//K branches, and the verdict warns)")
    v.add_argument("--operator", metavar="VKEY",
                   help="online mode with --witness: the windows came through this operator's log (witness operator "
                        "serve), its Ed25519 note key named by its origin; the witnesses cosigned its checkpoints")
    v.add_argument("--operator-url", metavar="URL",
                   help="with --operator: where its entries are read, to price the run's other attempts from the log "
                        "(every run of its seed); without it they are unknown")
    v.add_argument("--drand", metavar="quicknet|CHAIN-INFO.json",
                   help="online mode with --witness: the drand chain whose rounds give the randomness (quicknet, "
                        "pinned here, or a chain-info file)")
    v.add_argument("--response", help="the trainer's response folder (interactive mode)")
    v.add_argument("--tolerance", action="store_true",
                   help="replay on other hardware: compare within reported thresholds, and the whole state at "
                        "the end of every segment, instead of bit for bit (the default)")
    v.add_argument("--rtol", type=float, help="fingerprint threshold in tolerance mode")
    v.add_argument("--threshold", type=config_value, action="append",
                   help="tolerance-mode threshold NAME=VALUE (loss, fingerprint, sketch, update, parameters, "
                        "buffers, optimizer)")
    v.add_argument("--threads", type=positive,
                   help="replay threads (default: the run's recorded count; at most this machine's cores)")
    v.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="replay on the CPU (default) or the GPU; exact replay needs the hardware the run was "
                        "recorded on, other hardware needs --tolerance")
    v.add_argument("--ticket", type=hex_bytes, help="the r a ticket issuer handed out for this run (hex)")
    v.add_argument("--signer", help="pin the signer's public key: raw hex or PEM, or a file holding either")
    v.add_argument("--published-head", action="append",
                   help="a tree head published earlier (JSON); the log must extend it (repeatable)")
    v.add_argument("--leaves", help="the dataset's leaves file (witness data commit), where the bundle carries "
                                    "no dataset.leaves: every batch root and the used-data trees are checked "
                                    "against it")
    v.add_argument("--method", metavar="WHEEL",
                   help="a submitted method's wheel (its task plugin): the run must pin exactly its code, and its "
                        "steps are replayed only in a bubblewrap sandbox (interactive or online mode); the wheel "
                        "is never installed or imported here")
    v.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    data_arg(v)
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser("respond", help="answer a verifier's challenges with states and samples")
    r.add_argument("bundle", help="your bundle folder (its checkpoints rebuild the states)")
    challenge_args(r)
    r.add_argument("--tolerance", action="store_true",
                   help="the verifier replays in tolerance mode: also supply the state each segment ends at")
    r.add_argument("--out", help="the response folder to write (default: BUNDLE.response)")
    r.add_argument("--device", choices=["cpu", "cuda"],
                   help="rebuild the states on this device (default: the one the run trained on)")
    data_arg(r)
    r.set_defaults(func=cmd_respond)
