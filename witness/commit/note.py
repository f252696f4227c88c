"""C2SP signed notes, tlog-checkpoints and tlog-cosignatures (Ed25519), parsed strictly.

* c2sp.org/signed-note: a text ending in a newline, a blank line, then signature lines
  ``— <key name> base64(key ID || signature)``; keys are written as vkeys, ``name+hex(ID)+base64(type || key)``.
* c2sp.org/tlog-checkpoint: a note whose text is ``origin``, ``size``, ``base64(root)`` and optional
  extension lines.
* c2sp.org/tlog-cosignature: a witness's type 0x04 signature of ``cosignature/v1``, ``time T`` and the
  checkpoint's text, carried as ``u64 T || Ed25519 signature``; or its type 0x06 ML-DSA-44 signature of
  the ``subtree/v1`` message (the witness's name, T, the origin, 0, the size and the root: not the
  extension lines), carried as ``u64 T || ML-DSA-44 signature``.

Where Go's ``golang.org/x/mod/sumdb/note`` accepts more (upper-case key IDs, base64 with stray bits),
this module refuses it: every input here comes from someone else.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PublicKey

from ..errors import MalformedInput, VerificationError
from .ed25519 import check_public_key
from .hashing import HASH_SIZE, sha256

ED25519 = 0x01  # signed-note signature type: Ed25519 over the note's text
COSIGNATURE_V1 = 0x04  # tlog-cosignature: timestamped Ed25519 over "cosignature/v1\ntime T\n" + text
COSIGNATURE_MLDSA44 = 0x06  # tlog-cosignature: timestamped ML-DSA-44 over the subtree/v1 message
SIGNATURE_TYPES = (ED25519, COSIGNATURE_V1, COSIGNATURE_MLDSA44)
COSIGNER_TYPES = (COSIGNATURE_V1, COSIGNATURE_MLDSA44)
PUBLIC_BYTES = {ED25519: 32, COSIGNATURE_V1: 32, COSIGNATURE_MLDSA44: 1312}
SIGNATURE_BYTES = {COSIGNATURE_V1: 64, COSIGNATURE_MLDSA44: 2420}
MAX_NOTE_BYTES = 1 << 16
MAX_SIGNATURES = 100  # golang.org/x/mod's bound (the spec asks for at least 16)
MAX_NAME_BYTES = 255  # tlog-cosignature's ML-DSA format holds at most this; no name we meet is longer
MAX_VKEY_CHARS = 2048  # an ML-DSA-44 vkey: its name, ID and 1,313 bytes in base64 (1,752 characters)
MAX_TIMESTAMP = (1 << 63) - 1
MAX_TREE_SIZE = (1 << 64) - 1  # tlog-checkpoint sizes are unsigned 64-bit
RUN_ORIGIN_PREFIX = "witness.run/"
COSIGNATURE_HEADER = b"cosignature/v1\n"
SUBTREE_LABEL = b"subtree/v1\n\x00"  # the ML-DSA-44 cosigned message's 12-byte label

_SIZE = re.compile(r"0|[1-9][0-9]{0,19}")  # ASCII digits only (int() would take "+1", " 1", "1_0", "١")
_HEX8 = re.compile(r"[0-9a-f]{8}")
_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_RUN_ORIGIN = re.compile(re.escape(RUN_ORIGIN_PREFIX) + r"[0-9a-f]{64}")


def b64decode(text: str, what: str) -> bytes:
    """Standard base64 in its one canonical spelling (padded, no stray bits), else ``MalformedInput``."""
    if not isinstance(text, str) or not _B64.fullmatch(text) or len(text) % 4:
        raise MalformedInput(f"{what}: not standard padded base64")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedInput(f"{what}: not standard padded base64") from None
    if base64.b64encode(raw).decode() != text:  # a second spelling of the same bytes would let a note vary
        raise MalformedInput(f"{what}: base64 with non-zero padding bits (not its canonical spelling)")
    return raw


def b64encode(raw: bytes) -> str:
    """Standard padded base64."""
    return base64.b64encode(raw).decode()


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a key name (empty, a space, a plus, a control character, too long); None if it is."""
    if not isinstance(name, str) or not name:
        return "a key name is a non-empty text"
    if any(c.isspace() or c == "+" or ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "a key name holds no spaces, plus signs or control characters"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "a key name is UTF-8 text (it holds a lone surrogate)"
    return f"a key name is at most {MAX_NAME_BYTES} bytes" if size > MAX_NAME_BYTES else None


def _check_name(name: object, what: str = "key name") -> str:
    problem = name_problem(name)
    if problem:
        raise MalformedInput(f"{what}: {problem}")
    return name  # type: ignore[return-value]


def key_id(name: str, alg: int, public: bytes) -> bytes:
    """The 4-byte key ID: SHA-256(name || "\\n" || alg || public)[:4]."""
    return sha256(name.encode("utf-8") + b"\n" + bytes([alg]) + public)[:4]


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


MAX_ZERO_T1 = 64  # of an ML-DSA-44 key's 1,024 t1 coefficients; an honest key has about one zero


def _weak_mldsa44(public: bytes) -> bool:
    """Whether an ML-DSA-44 public key's t1 (after its 32-byte rho: 1,024 coefficients of 10 bits) has more
    than ``MAX_ZERO_T1`` zeros: under a t1 of zeros, or nearly, a signature with z = 0 verifies for any
    message, as a small-order Ed25519 key lets anyone sign."""
    t1 = int.from_bytes(public[32:], "little")
    return sum(1 for i in range(1024) if not (t1 >> (10 * i)) & 1023) > MAX_ZERO_T1


@dataclass(frozen=True)
class NoteKey:
    """A verifier key: a name, a signature type (0x01 note, 0x04 Ed25519 cosignature, 0x06 ML-DSA-44
    cosignature) and the raw public key (Ed25519's 32 bytes, ML-DSA-44's 1,312)."""

    name: str
    alg: int
    public: bytes

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.alg not in SIGNATURE_TYPES:
            raise MalformedInput(f"vkey: signature type {self.alg!r} is not Ed25519 (0x01), cosignature/v1 (0x04) "
                                 "or an ML-DSA-44 cosignature (0x06)")
        if not isinstance(self.public, bytes) or len(self.public) != PUBLIC_BYTES[self.alg]:
            raise MalformedInput(f"vkey: a type {self.alg:#04x} public key is {PUBLIC_BYTES[self.alg]} bytes")
        try:
            if self.alg == COSIGNATURE_MLDSA44:
                MLDSA44PublicKey.from_public_bytes(self.public)
                if _weak_mldsa44(self.public):  # (a t1 mostly of zeros lets anyone "sign")
                    raise ValueError("a weak ML-DSA-44 key (its t1 is mostly zeros)")
            else:
                check_public_key(self.public)  # a small-order key lets anyone "sign"
        except ValueError as e:
            raise MalformedInput(f"vkey: bad public key: {e}") from None

    @property
    def id(self) -> bytes:
        """The key ID its signature lines carry."""
        return key_id(self.name, self.alg, self.public)

    def vkey(self) -> str:
        """The key as a vkey: ``name+hex8(id)+base64(alg || public)``."""
        return f"{self.name}+{self.id.hex()}+{b64encode(bytes([self.alg]) + self.public)}"

    def ed25519(self) -> Ed25519PublicKey:
        """The Ed25519 public key."""
        return Ed25519PublicKey.from_public_bytes(self.public)

    def mldsa44(self) -> MLDSA44PublicKey:
        """The ML-DSA-44 public key (a type 0x06 key)."""
        return MLDSA44PublicKey.from_public_bytes(self.public)

    @classmethod
    def parse(cls, vkey: str) -> NoteKey:
        """Strictly parse a vkey (lowercase hex ID, canonical base64, the ID matching the key)."""
        if not isinstance(vkey, str) or len(vkey) > MAX_VKEY_CHARS:
            raise MalformedInput(f"vkey: a text of at most {MAX_VKEY_CHARS} characters")
        name, _, rest = vkey.partition("+")
        hex8, _, key64 = rest.partition("+")  # base64 has "+" of its own: the key is all that follows
        _check_name(name, "vkey")
        if not _HEX8.fullmatch(hex8):
            raise MalformedInput("vkey: the key ID is 8 lowercase hex digits")
        raw = b64decode(key64, "vkey")
        if len(raw) not in (33, 1313):
            raise MalformedInput("vkey: the key is a type byte and an Ed25519 (32 bytes) or ML-DSA-44 (1,312 bytes) "
                                 "public key")
        key = cls(name, raw[0], raw[1:])
        if key.id.hex() != hex8:
            raise MalformedInput(f"vkey: the key ID {hex8} is not that of the key ({key.id.hex()})")
        return key

    @classmethod
    def of(cls, name: str, public: Ed25519PublicKey | MLDSA44PublicKey, alg: int = ED25519) -> NoteKey:
        """The vkey of a public key under ``name`` (an ML-DSA-44 key is a cosigner's, type 0x06)."""
        if isinstance(public, MLDSA44PublicKey):
            return cls(name, COSIGNATURE_MLDSA44, public.public_bytes_raw())
        return cls(name, alg, _raw(public))


@dataclass(frozen=True)
class NoteSignature:
    """One signature line: the signer's name, the key ID, and the signature bytes after the ID."""

    name: str
    key_id: bytes
    sig: bytes

    def line(self) -> str:
        """The line as a note carries it: ``— name base64(key_id || sig)`` and a newline."""
        return f"— {self.name} {b64encode(self.key_id + self.sig)}\n"

    @classmethod
    def parse(cls, line: str) -> NoteSignature:
        """Strictly parse one signature line (without its newline)."""
        if not isinstance(line, str) or not line.startswith("— "):
            raise MalformedInput("note: a signature line starts with an em dash and a space")
        name, _, b64 = line[2:].partition(" ")
        _check_name(name, "note: signature line")
        if not b64:
            raise MalformedInput("note: a signature line has a name and a signature")
        raw = b64decode(b64, "note: signature line")
        if len(raw) < 5:
            raise MalformedInput("note: a signature is a 4-byte key ID and at least one byte")
        return cls(name, raw[:4], raw[4:])


def _text_problem(text: str) -> str | None:
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        return "holds a control character other than newline"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not UTF-8 text (a lone surrogate)"
    return None


@dataclass(frozen=True)
class Note:
    """A signed note: its text (ending in a newline) and its signature lines, in order; ``others``: the
    name and the key ID of each line that Go's reader takes but that is not in its strict
    spelling (stray base64 bits, a long name), which counts only if it claims a key someone checks (``of_key``)."""

    text: str
    signatures: tuple[NoteSignature, ...]
    others: tuple[tuple[str, bytes], ...] = ()

    def encode(self) -> bytes:
        """The note's bytes: the text, a blank line, and every signature line (strictly spelled)."""
        return (self.text + "\n" + "".join(s.line() for s in self.signatures)).encode("utf-8")

    def of_key(self, key: NoteKey) -> list[NoteSignature]:
        """The signature lines of ``key`` (its name and ID); lines of other keys are ignored, whatever their
        spelling (signed-note), but a line of this key not in its strict spelling is refused."""
        if any(name == key.name and kid == key.id for name, kid in self.others):
            raise MalformedInput(f"note: a signature line of {key.name} is not in its strict spelling")
        return [s for s in self.signatures if s.name == key.name and s.key_id == key.id]


def _loose_signature(line: str) -> tuple[str, bytes]:
    """The name and key ID of a signature line that is well formed by Go's ``note.Open`` (a name without
    spaces or plus signs, base64 that decodes, stray bits allowed, to at least 5 bytes) but not in this
    module's strict spelling; ``MalformedInput`` for a line no reader takes."""
    name, _, b64 = line[2:].partition(" ")
    try:  # Go's StdEncoding: padded to a multiple of 4, at most two "=" (stray bits allowed)
        raw = base64.b64decode(b64, validate=True) if b64 and len(b64) % 4 == 0 and _B64.fullmatch(b64) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if not name or any(c.isspace() or c == "+" for c in name) or len(raw) < 5:
        raise MalformedInput("note: a signature line is an em dash, a space, a key name, a space and base64 of a "
                             "key ID and a signature")
    return name, raw[:4]


def parse_note(msg: bytes, max_bytes: int = MAX_NOTE_BYTES) -> Note:
    """Strictly parse a signed note (signed-note's rules; signatures are checked by the caller).

    A line repeated exactly is kept once, as Go's ``note.Open`` drops such repeats."""
    if not isinstance(msg, bytes):
        raise MalformedInput("note: bytes expected")
    if len(msg) > max_bytes:
        raise MalformedInput(f"note: over {max_bytes} bytes")
    try:
        whole = msg.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedInput("note: not UTF-8") from None
    problem = _text_problem(whole)
    if problem:
        raise MalformedInput(f"note: {problem}")
    split = whole.rfind("\n\n")  # the last blank line ends the text: the text itself may hold blank lines
    if split < 0:
        raise MalformedInput("note: no blank line between the text and the signatures")
    text, block = whole[: split + 1], whole[split + 2 :]
    if not block or not block.endswith("\n"):
        raise MalformedInput("note: the signature lines are missing or do not end in a newline")
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise MalformedInput(f"note: over {MAX_SIGNATURES} signature lines")
    sigs: list[NoteSignature] = []
    others: list[tuple[str, bytes]] = []
    for line in lines:
        try:
            sig = NoteSignature.parse(line)
        except MalformedInput:  # ignored unless it claims a key that is checked (Note.of_key)
            if not line.startswith("— "):
                raise
            others.append(_loose_signature(line))
            continue
        if sig not in sigs:
            sigs.append(sig)
    return Note(text, tuple(sigs), tuple(others))


def _check_text(text: object) -> str:
    if not isinstance(text, str) or not text.endswith("\n"):
        raise MalformedInput("note: a note's text ends in a newline")
    problem = _text_problem(text)
    if problem:
        raise MalformedInput(f"note: the text {problem}")
    return text


def sign_note(text: str, name: str, key: Ed25519PrivateKey) -> NoteSignature:
    """An Ed25519 (type 0x01) signature of ``text`` by ``key`` under ``name``."""
    _check_text(text)
    _check_name(name)
    return NoteSignature(name, key_id(name, ED25519, _raw(key.public_key())), key.sign(text.encode("utf-8")))


def verify_note_signature(note: Note, key: NoteKey) -> bool:
    """True if the lines of ``key``'s name and ID verify, False if there is none; ``VerificationError``
    if one of them does not verify (a known key's bad signature rejects the note)."""
    if key.alg != ED25519:
        raise VerificationError(f"the key {key.name} is of type {key.alg:#04x}, not an Ed25519 note key (0x01)")
    kid = key.id
    # a line under another key (or the same name with another ID) is ignored, as the spec says; every
    # line of this key is checked (Go checks the first and drops the rest unread)
    mine = note.of_key(key)
    public, text = key.ed25519(), note.text.encode("utf-8")
    for sig in mine:
        try:
            public.verify(sig.sig, text)
        except InvalidSignature:
            raise VerificationError(f"the signature of {key.name}+{kid.hex()} on the note does not verify",
                                    check="note") from None
    return bool(mine)


@dataclass(frozen=True)
class Checkpoint:
    """A log's tree head as a tlog-checkpoint: origin, size, root hash and extension lines."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def text(self) -> str:
        """The note text: origin, size, base64 root and each extension line, each ending in a newline."""
        return f"{self.origin}\n{self.size}\n{b64encode(self.root)}\n" + "".join(e + "\n" for e in self.extensions)

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        """Strictly parse a checkpoint's text (tlog-checkpoint's rules)."""
        _check_text(text)
        lines = text[:-1].split("\n")
        if len(lines) < 3:
            raise MalformedInput("checkpoint: an origin, a size and a root hash, a line each")
        origin, size, root, *ext = lines
        if not origin:
            raise MalformedInput("checkpoint: the origin line is empty")
        if not _SIZE.fullmatch(size) or int(size) > MAX_TREE_SIZE:
            raise MalformedInput("checkpoint: the size is a decimal of at most 64 bits with no leading zeroes")
        raw = b64decode(root, "checkpoint: root hash")
        if len(raw) != HASH_SIZE:
            raise MalformedInput(f"checkpoint: the root hash is {HASH_SIZE} bytes")
        if any(not e for e in ext):
            raise MalformedInput("checkpoint: an extension line is empty")
        return cls(origin, int(size), raw, tuple(ext))


def run_origin(run_id: bytes) -> str:
    """A run's log origin: ``witness.run/`` and its run ID (the manifest's leaf hash) in hex."""
    if not isinstance(run_id, bytes) or len(run_id) != HASH_SIZE:
        raise ValueError(f"a run ID is {HASH_SIZE} bytes")
    return RUN_ORIGIN_PREFIX + run_id.hex()


def is_run_origin(origin: object) -> bool:
    """Whether ``origin`` is a run's origin as ``run_origin`` spells it."""
    return isinstance(origin, str) and _RUN_ORIGIN.fullmatch(origin) is not None


def origin_hash(origin: str) -> str:
    """The origin's SHA-256 in lowercase hex (tlog-witness's monitoring path names a log by it)."""
    return sha256(origin.encode("utf-8")).hex()


def parse_signer_key(skey: str) -> tuple[str, Ed25519PrivateKey]:
    """The name and key of golang.org/x/mod's private key text, ``PRIVATE+KEY+name+hex8(id)+base64(0x01 || seed)``."""
    if not isinstance(skey, str) or len(skey) > MAX_VKEY_CHARS or not skey.startswith("PRIVATE+KEY+"):
        raise MalformedInput("signer key: not PRIVATE+KEY+name+id+key")
    name, _, rest = skey[len("PRIVATE+KEY+") :].partition("+")
    hex8, _, key64 = rest.partition("+")
    _check_name(name, "signer key")
    if not _HEX8.fullmatch(hex8):
        raise MalformedInput("signer key: the key ID is 8 lowercase hex digits")
    raw = b64decode(key64, "signer key")
    if len(raw) != 33 or raw[0] != ED25519:
        raise MalformedInput("signer key: the key is the type byte 0x01 and a 32-byte Ed25519 seed")
    key = Ed25519PrivateKey.from_private_bytes(raw[1:])
    if key_id(name, ED25519, _raw(key.public_key())).hex() != hex8:  # the ID names the public key it derives
        raise MalformedInput("signer key: the key ID is not that of the key")
    return name, key
