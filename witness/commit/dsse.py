"""in-toto Statements in DSSE envelopes, the carrier that sigstore's model signing uses."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..errors import MalformedInput, VerificationError
from .hashing import canonical_json, load_json
from .signing import public_hex, public_key_from_hex

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_BASE = "https://witness.dev/predicates"


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
    """Sign a Statement into a DSSE envelope (keyid: the raw Ed25519 public key, hex)."""
    payload = canonical_json(stmt)
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": public_hex(key.public_key()), "sig": base64.b64encode(sig).decode()}],
    }


def open_envelope(env: Any, public_key: str | None = None) -> dict:
    """Verify a DSSE envelope's signature (by ``public_key`` if pinned) and return its Statement."""
    if not isinstance(env, dict) or env.get("payloadType") != PAYLOAD_TYPE or not env.get("signatures"):
        raise MalformedInput("not a DSSE envelope of an in-toto Statement")
    try:
        payload = base64.b64decode(env["payload"], validate=True)
        sigs = [(s["keyid"], base64.b64decode(s["sig"], validate=True)) for s in env["signatures"]]
        stmt = load_json(payload)
    except (KeyError, TypeError, ValueError):
        raise MalformedInput("malformed DSSE envelope") from None
    for keyid, sig in sigs:
        if public_key is not None and keyid != public_key:
            continue
        key = public_key_from_hex(keyid)  # a malformed or weak key is refused as such
        try:
            key.verify(sig, pae(PAYLOAD_TYPE, payload))
        except Exception:
            raise VerificationError("the DSSE envelope's signature is invalid", check="signature") from None
        if not isinstance(stmt, dict) or stmt.get("_type") != STATEMENT_TYPE:
            raise MalformedInput("the envelope does not hold an in-toto v1 Statement")
        return stmt
    raise VerificationError("no signature on the envelope by the expected key", check="signature")


def read_json_or_envelope(path: str | os.PathLike, limit: int, what: str) -> Any:
    """A JSON file of at most ``limit`` bytes; a DSSE envelope yields its Statement's predicate."""
    return read_with_statement(path, limit, what)[0]


def read_with_statement(path: str | os.PathLike, limit: int, what: str) -> tuple[Any, dict | None]:
    """A JSON file, or a DSSE envelope's predicate with its verified Statement (else ``None``)."""
    p = Path(path)
    if not p.is_file() or p.stat().st_size > limit:
        raise MalformedInput(f"{p} is not a {what} file of at most {limit} bytes")
    try:
        obj = load_json(p.read_bytes())
    except ValueError:
        raise MalformedInput(f"{p} is not JSON") from None
    if isinstance(obj, dict) and "payloadType" in obj:
        stmt = open_envelope(obj)
        predicate = stmt.get("predicate")
        if predicate is None:
            raise MalformedInput(f"{p}: the envelope's Statement has no predicate")
        return predicate, stmt
    return obj, None
