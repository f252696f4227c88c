"""Ed25519 keys and signed tree heads (through ``cryptography``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

from ..errors import MalformedInput, VerificationError
from .ed25519 import check_public_key
from .hashing import canonical_json, from_hex, sha256, tagged_hash

STH_CONTEXT = "witness/signed-tree-head/v1"


# the kinds of key a file may hold: Ed25519 for everything, ML-DSA-44 for a witness's cosignatures only
KEY_KINDS = {"ed25519": Ed25519PrivateKey, "ml-dsa-44": MLDSA44PrivateKey}


def generate_key(kind: str = "ed25519") -> Ed25519PrivateKey:
    """A fresh signing key: Ed25519, or (``kind="ml-dsa-44"``) an ML-DSA-44 cosigner key."""
    return KEY_KINDS[kind].generate()  # type: ignore[return-value]


def secret_r(text: str, key: Ed25519PrivateKey) -> bytes:
    """The trainer's r from a text of its choosing and its signing key: the same text and key give the
    same r, and no one without the key can compute it. (r from the text alone, ``--seed 0``, is a run
    seed anyone could guess from the public data root, and a stranger who opens runs of that seed at a
    beacon has each priced as an attempt at this run.)"""
    return tagged_hash("witness/trainer-seed/v2", key.private_bytes_raw(), text.encode())


def save_key(key: Ed25519PrivateKey | MLDSA44PrivateKey, path: Path) -> Path:
    """Write the private key as unencrypted PKCS#8 PEM (mode 0600) and the public key beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return _save_public(key, path)


def _save_public(key: Ed25519PrivateKey | MLDSA44PrivateKey, path: Path) -> Path:
    pub = path.with_suffix(".pub")
    pub.write_text(public_hex(key.public_key()) + "\n")
    pub.with_name(pub.name + ".pem").write_text(public_pem(key.public_key()))  # for tools that read PEM
    return pub


def load_key(path: Path, kind: str = "ed25519") -> Ed25519PrivateKey:
    """Load an Ed25519 (or ``kind``'s) private key from a PEM file."""
    data = Path(path).read_bytes()
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, KEY_KINDS[kind]):
        raise ValueError(f"{path} is not an {'Ed25519' if kind == 'ed25519' else kind.upper()} private key")
    return key  # type: ignore[return-value]


def load_or_create_key(path: Path, kind: str = "ed25519") -> Ed25519PrivateKey:
    """Load the key at ``path``, creating one there first if it does not exist.

    Two processes that start together (a server and its workers) end with the same key: the new
    key is written aside and linked into place, which fails for all but the first.
    """
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
        key = generate_key(kind)
        save_key(key, tmp)
        try:
            os.link(tmp, path)
            _save_public(key, path)
        except FileExistsError:
            pass
        finally:
            for leftover in (tmp, tmp.with_suffix(".pub"), tmp.with_suffix(".pub.pem")):
                leftover.unlink(missing_ok=True)
    return load_key(path, kind)


def public_hex(key: Ed25519PublicKey) -> str:
    """The raw 32-byte public key as hex."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def public_pem(key: Ed25519PublicKey) -> str:
    """The public key as PEM (SubjectPublicKeyInfo), the form OpenSSL, sigstore and in-toto read."""
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


MAX_PUBLIC_KEY_TEXT = 4096  # a PEM public key is ~113 bytes; anything far larger is not one


def parse_public_key(text: str) -> str:
    """A public key given as raw hex or as PEM (SubjectPublicKeyInfo): its canonical raw hex.

    Weak and malformed keys are refused (``MalformedInput``), whichever form they came in.
    """
    if not isinstance(text, str) or len(text) > MAX_PUBLIC_KEY_TEXT:
        raise MalformedInput("bad public key: not a hex or PEM key of sensible length")
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text.encode())
        except (ValueError, TypeError) as e:
            raise MalformedInput(f"bad public key: unreadable PEM ({e})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise MalformedInput("bad public key: the PEM holds a key of another kind, not Ed25519")
        text = public_hex(key)
    text = text.lower()  # hex digits in either case name the same key
    public_key_from_hex(text)  # canonical encoding, a point of prime order
    return text


def read_public_key(value: str | os.PathLike) -> str:
    """A public key named on a command line: hex or PEM text, or a file holding either."""
    text = str(value)
    if not text.strip().startswith("-----BEGIN") and not _looks_hex(text):
        path = Path(text)
        if path.stat().st_size > MAX_PUBLIC_KEY_TEXT:
            raise MalformedInput(f"{path} is too large to be a public key")
        text = path.read_text(errors="replace")
    return parse_public_key(text)


def _looks_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def public_key_from_hex(value: object) -> Ed25519PublicKey:
    """Parse a raw hex Ed25519 public key, refusing weak ones (see ``ed25519.check_public_key``)."""
    try:
        raw = from_hex(value, "public key", 32)
        check_public_key(raw)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise MalformedInput(f"bad public key: {e}") from None


def key_fingerprint(public: str) -> str:
    """A short, stable name for a public key (first 16 hex of its SHA-256)."""
    return sha256(bytes.fromhex(public)).hex()[:16]


MAX_TREE_SIZE = (1 << 31) - 1  # records a log may hold: a 32-bit database integer


@dataclass(frozen=True)
class SignedTreeHead:
    """A log's size and root at a moment, signed by the trainer's key."""

    size: int
    root: bytes
    timestamp_ms: int
    signature: bytes
    # Signed extra facts, as RFC 9162 tree heads carry extensions; the final head of a run
    # states its used-data commitments here, so a data proof needs no log path to them.
    extensions: dict | None = None

    @staticmethod
    def message(size: int, root: bytes, timestamp_ms: int, extensions: dict | None = None) -> bytes:
        """The exact bytes that are signed."""
        body = {"context": STH_CONTEXT, "size": size, "root": root.hex(), "timestamp_ms": timestamp_ms}
        if extensions is not None:
            body["extensions"] = extensions
        return canonical_json(body)

    @classmethod
    def sign(cls, key: Ed25519PrivateKey, size: int, root: bytes, timestamp_ms: int | None = None,
             extensions: dict | None = None) -> SignedTreeHead:
        """Sign a tree head now (or at ``timestamp_ms``)."""
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        return cls(size, root, ts, key.sign(cls.message(size, root, ts, extensions)), extensions)

    def verify(self, public: Ed25519PublicKey) -> None:
        """Raise unless the signature is valid for ``public``."""
        try:
            public.verify(self.signature, self.message(self.size, self.root, self.timestamp_ms, self.extensions))
        except InvalidSignature:
            raise VerificationError(
                f"signature on the tree head of size {self.size} is invalid", check="signature"
            ) from None

    def to_json(self) -> dict:
        """JSON form."""
        out = {
            "size": self.size,
            "root": self.root.hex(),
            "timestamp_ms": self.timestamp_ms,
            "signature": self.signature.hex(),
        }
        if self.extensions is not None:
            out["extensions"] = self.extensions
        return out

    @classmethod
    def from_json(cls, obj: object) -> SignedTreeHead:
        """Strictly parse the JSON form."""
        fields = {"size", "root", "timestamp_ms", "signature"}
        if not isinstance(obj, dict) or not fields <= set(obj) <= fields | {"extensions"}:
            raise MalformedInput("a signed tree head has size, root, timestamp_ms, signature and optional extensions")
        ext = obj.get("extensions")
        if ext is not None and not isinstance(ext, dict):
            raise MalformedInput("tree head extensions must be an object")
        size, ts = obj["size"], obj["timestamp_ms"]
        if type(size) is not int or type(ts) is not int or size < 0 or ts < 0:
            raise MalformedInput("tree head size and timestamp must be non-negative integers")
        if size > MAX_TREE_SIZE or ts >= 1 << 62:
            # no log is that long (its records alone would pass every bound); a database's integer columns
            # and the beacon's statements hold what is accepted here
            raise MalformedInput(f"a tree head's size is at most {MAX_TREE_SIZE} and its timestamp below 2^62")
        try:
            return cls(size, from_hex(obj["root"], "root"), ts, from_hex(obj["signature"], "signature", 64), ext)
        except ValueError as e:
            raise MalformedInput(f"bad tree head: {e}") from None
