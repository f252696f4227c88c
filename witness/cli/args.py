"""Argument types and shared flags of the ``witness`` command."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..errors import MalformedInput, VerificationError

DEFAULT_KEY = Path(os.environ.get("WITNESS_KEY", Path.home() / ".witness" / "signing_key.pem"))


def hex_bytes(value: str) -> bytes:
    """Bytes written as hex digits, two a byte."""
    try:
        return bytes.fromhex(value)
    except ValueError:
        digits = value.strip()
        if digits and all(c in "0123456789abcdefABCDEF" for c in digits) and len(digits) % 2:
            raise argparse.ArgumentTypeError(f"{value[:40]!r} has an odd number of hex digits ({len(digits)}): "
                                             "two digits make a byte (pad with a leading 0)") from None
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not hex (digits 0-9 and a-f, two a byte)") from None


def digest_hex(value: str) -> bytes:
    """A SHA-256 digest written as 64 hex digits (a data root, a state hash)."""
    raw = hex_bytes(value)
    if len(raw) != 32:
        raise argparse.ArgumentTypeError(f"a SHA-256 digest is 64 hex digits, not {len(value.strip())}")
    return raw


def fraction(value: str) -> float:
    v = float(value)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError("must lie strictly between 0 and 1")
    return v


def parsed(value: str, cast: type = float, what: str = "a number") -> float:
    """``value`` as a number (``cast``), or the argument error that says it is not ``what``."""
    try:
        return cast(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not {what}") from None


def seconds(value: str) -> float:
    """A positive duration in seconds (at most a day)."""
    v = parsed(value, float, "a number of seconds")
    if not 0 < v <= 86400:
        raise argparse.ArgumentTypeError("must lie in (0, 86400] seconds")
    return v


UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12}


def memory(value: str) -> int:
    """An amount of memory: bytes, or a number with a unit (512MiB, 8GiB, 1.5GB)."""
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)([a-z]*)", value.strip().lower().replace(" ", ""))
    if found is None or found.group(2) not in UNITS:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not an amount of memory (say 8GiB or 512MiB)")
    v = int(float(found.group(1)) * UNITS[found.group(2)])
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least one byte")
    return v


def share(value: str) -> float:
    """A share of something in [0, 1] (0: none)."""
    v = parsed(value)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError("must lie in [0, 1]")
    return v


def probability(value: str) -> float:
    v = parsed(value)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError("must lie in (0, 1]")
    return v


def positive(value: str) -> int:
    v = int(value)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def chunk_count(value: str) -> int:
    from ..bundle.schema import MAX_OPENED_CHUNKS

    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number") from None
    if not 0 <= v <= MAX_OPENED_CHUNKS:
        raise argparse.ArgumentTypeError(f"must lie in 0 .. {MAX_OPENED_CHUNKS}")
    return v


def config_value(text: str):
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError("use KEY=VALUE")
    from ..commit.hashing import load_json

    try:
        return key, load_json(raw)
    except ValueError:  # not JSON (or nested absurdly deep): the value is the text itself
        return key, raw


def trainer_r(seed: str | None, key) -> bytes:  # noqa: ANN001 - an Ed25519PrivateKey
    """``--seed``'s r: fresh randomness, or the text's under the signing key (``secret_r``)."""
    from ..commit.signing import secret_r

    return os.urandom(32) if seed is None else secret_r(seed, key)


def data_arg(p: argparse.ArgumentParser) -> None:
    """``--data DIR``: where the recipe's data files are looked up (repeatable)."""
    p.add_argument("--data", dest="data_dirs", action="append", metavar="DIR",
                   help="a folder to find the training data in, by the names the recipe gives and, for an audit, "
                        "by the committed root (repeatable; also WITNESS_DATA, then the working folder)")


def challenge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--challenges", type=positive, help="number of replay challenges q")
    g.add_argument("--confidence", type=fraction,
                   help="choose q so that detection >= C, and call an accepted audit weak below C; with neither "
                        "--confidence nor --challenges, q is chosen for 99 %% and a bound below 90 %% is weak")
    p.add_argument("--bad-fraction", type=fraction, default=None, help="fraction f of bad steps to detect (default 0.05)")
    p.add_argument("--length", type=positive, default=1, help="steps replayed per challenge (default 1)")
    p.add_argument("--nonce", type=hex_bytes, help="the verifier's nonce (hex); random by default")


def challenges_q(args: argparse.Namespace) -> int:
    from ..verify.audit import DEFAULT_BAD_FRACTION, DEFAULT_CONFIDENCE
    from ..verify.challenges import challenges_needed

    if args.challenges:
        return args.challenges
    return challenges_needed(args.confidence or DEFAULT_CONFIDENCE, args.bad_fraction or DEFAULT_BAD_FRACTION)


def one_line(text: str, limit: int | None = 300) -> str:
    """A message on one line of bounded length (a 5000-character path is not worth repeating);
    ``limit=None`` keeps it whole."""
    text = " ".join(text.split())
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def unusable_or_rejected(e: VerificationError, rejected: str = "REJECTED") -> str:
    """The one line that reports a failed check: unusable input (exit 2) or a rejection (exit 1)."""
    if isinstance(e, MalformedInput):
        return f"UNUSABLE INPUT: {one_line(str(e), 1000)}"
    return f"{rejected}: {e}"
