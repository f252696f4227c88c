"""in-toto Statements in DSSE envelopes, the carrier that sigstore's model signing uses.

A signature's ``keyid`` is only a hint (DSSE: it "MUST NOT be used for security decisions"): a
signature is checked against a key the verifier pins or already trusts, or, where it pins none,
against the keys the envelope and its Statement name; the key that verified is reported with
whether anything pins it, and a keyid that is no key (securesystemslib's default, a hash) is no
error.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import MalformedInput, VerificationError
from .hashing import canonical_json, load_json, sha256
from .signing import public_hex, public_key_from_hex

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_BASE = "https://witness.dev/predicates"

MAX_SIGNATURES = 16  # one per signer; an envelope with more is not one a verifier should loop over
MAX_KEYID_CHARS = 512  # a raw key or a hash is 64; room for URIs and fingerprints of other tools
MAX_SIG_CHARS = 4096  # base64 of an Ed25519 signature is 88; room for others' (skipped, not ours)
# Where our predicates name a key: a data proof's run key, an evaluation certificate's evaluator.
PAYLOAD_KEY_FIELDS = ("public_key", "evaluator")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding: what is actually signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def statement(subjects: list[dict], predicate_type: str, predicate: dict) -> dict:
    """An in-toto v1 Statement about ``subjects`` (files: ``{"name", "digest": {"sha256"}}``)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": f"{PREDICATE_BASE}/{predicate_type}",
        "predicate": predicate,
    }


def envelope(stmt: dict, key: Ed25519PrivateKey) -> dict:
    """Sign a Statement into a DSSE envelope (keyid: the raw Ed25519 public key, hex: a hint only)."""
    payload = canonical_json(stmt)
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": public_hex(key.public_key()), "sig": base64.b64encode(sig).decode()}],
    }


def sslib_keyid(public: str) -> str:
    """securesystemslib's default keyid of a raw hex Ed25519 key: SHA-256 of its canonical key JSON."""
    return sha256(canonical_json({"keytype": "ed25519", "scheme": "ed25519", "keyval": {"public": public}})).hex()


@dataclass(frozen=True)
class SignedStatement:
    """A DSSE envelope's Statement, the key (raw hex) whose signature on it verified, and whether
    that key is one the verifier pinned or trusts (else only the envelope or its Statement named it)."""

    statement: dict
    signer: str
    trusted: bool


def _parse(env: Any) -> tuple[bytes, Any, list[tuple[str, bytes]]]:
    """The payload, its JSON and the (keyid, signature) pairs of an envelope, parsed strictly."""
    if not isinstance(env, dict) or env.get("payloadType") != PAYLOAD_TYPE or not env.get("signatures"):
        raise MalformedInput("not a DSSE envelope of an in-toto Statement")
    if set(env) != {"payloadType", "payload", "signatures"}:
        raise MalformedInput("a DSSE envelope has exactly payloadType, payload and signatures")
    signatures = env["signatures"]
    if not isinstance(signatures, list) or len(signatures) > MAX_SIGNATURES:
        raise MalformedInput(f"a DSSE envelope's signatures are a list of at most {MAX_SIGNATURES}")
    sigs = []
    for s in signatures:
        # DSSE: "sig" is required, "keyid" optional (and may be empty)
        if not isinstance(s, dict) or "sig" not in s or not set(s) <= {"keyid", "sig"}:
            raise MalformedInput("a DSSE signature has a sig and an optional keyid, nothing else")
        keyid, sig = s.get("keyid", ""), s["sig"]
        if not isinstance(keyid, str) or len(keyid) > MAX_KEYID_CHARS or not isinstance(sig, str) \
                or len(sig) > MAX_SIG_CHARS:
            raise MalformedInput(f"a DSSE signature's keyid (at most {MAX_KEYID_CHARS} characters) and sig "
                                 f"(at most {MAX_SIG_CHARS}) are strings")
        try:
            sigs.append((keyid, base64.b64decode(sig, validate=True)))
        except ValueError:
            raise MalformedInput("a DSSE signature is not base64") from None
    if not isinstance(env["payload"], str):
        raise MalformedInput("a DSSE envelope's payload is a base64 string")
    try:
        payload = base64.b64decode(env["payload"], validate=True)
        return payload, load_json(payload), sigs
    except ValueError:
        raise MalformedInput("malformed DSSE envelope: its payload is not base64 of JSON") from None


def _key(value: Any) -> Ed25519PublicKey | None:
    """A key named by something the verifier does not trust: None where it is no (good) Ed25519 key."""
    try:
        return public_key_from_hex(value)
    except MalformedInput:  # a hash keyid, say: a hint that names no key of ours
        return None


def _signs(key: Ed25519PublicKey, sigs: list[tuple[str, bytes]], message: bytes) -> bool:
    for _, sig in sigs:
        if len(sig) != 64:  # another scheme's signature (ECDSA, say): not one an Ed25519 key made
            continue
        try:
            key.verify(sig, message)
            return True
        except InvalidSignature:
            continue
    return False


def _named_keys(stmt: Any, sigs: list[tuple[str, bytes]]) -> list[str]:
    """Keys the Statement's predicate and the signatures' keyids name, in that order, each once."""
    predicate = stmt.get("predicate") if isinstance(stmt, dict) else None
    named = [predicate.get(f) for f in PAYLOAD_KEY_FIELDS] if isinstance(predicate, dict) else []
    out: list[str] = []
    for k in [*named, *(keyid for keyid, _ in sigs)]:
        if isinstance(k, str) and k not in out:
            out.append(k)
    return out


def _statement(stmt: Any) -> dict:
    if not isinstance(stmt, dict) or stmt.get("_type") != STATEMENT_TYPE:
        raise MalformedInput("the envelope does not hold an in-toto v1 Statement")
    return stmt


def verify_envelope(env: Any, *, pinned: str | None = None, trusted: Sequence[str] = ()) -> SignedStatement:
    """Verify a DSSE envelope: by ``pinned`` alone if given, else by a ``trusted`` key or one it names.

    Keys are raw hex. A keyid never decides anything: with ``pinned``, every signature is tried
    against that key whatever its keyid says; without, a key the Statement or a keyid names may
    verify it, and is reported as the signer with ``trusted`` False: such a signature proves
    nothing about who made the Statement.
    """
    payload, stmt, sigs = _parse(env)
    message = pae(PAYLOAD_TYPE, payload)
    if pinned is not None:
        if _signs(public_key_from_hex(pinned), sigs, message):  # a weak pinned key is refused as such
            return SignedStatement(_statement(stmt), pinned, True)
        if any(keyid in (pinned, sslib_keyid(pinned)) for keyid, _ in sigs):  # only to say what is wrong
            raise VerificationError(f"the DSSE envelope's signature is invalid (its keyid names the pinned key "
                                    f"{pinned})", check="signature")
        raise VerificationError(f"no signature on the envelope by the expected key {pinned} (none of its "
                                f"{len(sigs)} signature(s) verifies under it)", check="signature")
    for k in trusted:
        if _signs(public_key_from_hex(k), sigs, message):
            return SignedStatement(_statement(stmt), k, True)
    candidates = [(k, key) for k in _named_keys(stmt, sigs) if k not in trusted and (key := _key(k)) is not None]
    for k, key in candidates:
        if _signs(key, sigs, message):
            return SignedStatement(_statement(stmt), k, False)
    if not candidates and not trusted:
        raise MalformedInput("the DSSE envelope names no Ed25519 key to check its signature with (its keyid is "
                             "only a hint, and no key: a hash, say; its Statement names none): pin the signer's "
                             "key with --signer")
    raise VerificationError("the DSSE envelope's signature is invalid: no signature on it verifies under "
                            f"{len(candidates) + len(trusted)} key(s) it or its Statement names or the verifier "
                            "trusts", check="signature")


def open_envelope(env: Any, public_key: str | None = None) -> dict:
    """Verify a DSSE envelope's signature (by ``public_key`` alone if pinned) and return its Statement."""
    return verify_envelope(env, pinned=public_key).statement


def read_json_or_envelope(path: str | os.PathLike, limit: int, what: str) -> Any:
    """A JSON file of at most ``limit`` bytes; a DSSE envelope yields its Statement's predicate."""
    return read_signed(path, limit, what)[0]


def read_with_statement(path: str | os.PathLike, limit: int, what: str) -> tuple[Any, dict | None]:
    """A JSON file, or a DSSE envelope's predicate with its verified Statement (else ``None``)."""
    obj, signed = read_signed(path, limit, what)
    return obj, signed.statement if signed else None


def read_signed(path: str | os.PathLike, limit: int, what: str, *, pinned: str | None = None,
                trusted: Sequence[str] = ()) -> tuple[Any, SignedStatement | None]:
    """A JSON file, or a DSSE envelope's predicate with its verified signature (else ``None``)."""
    p = Path(path)
    if not p.is_file() or p.stat().st_size > limit:
        raise MalformedInput(f"{p} is not a {what} file of at most {limit} bytes")
    try:
        obj = load_json(p.read_bytes())
    except ValueError:
        raise MalformedInput(f"{p} is not JSON") from None
    if isinstance(obj, dict) and "payloadType" in obj:
        signed = verify_envelope(obj, pinned=pinned, trusted=trusted)
        predicate = signed.statement.get("predicate")
        if predicate is None:
            raise MalformedInput(f"{p}: the envelope's Statement has no predicate")
        return predicate, signed
    return obj, None
