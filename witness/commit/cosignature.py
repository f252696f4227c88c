"""tlog-cosignature: a witness's cosignatures of checkpoints (Ed25519 cosignature/v1, type 0x04, and
ML-DSA-44, type 0x06), and the notes a witness signs of its own (its attempts counts), with the same key.

* cosignature/v1 signs ``cosignature/v1``, ``time T`` and the checkpoint's whole text; the line carries
  ``u64 T || Ed25519 signature``.
* ML-DSA-44 signs the ``subtree/v1`` message (the witness's name, T, the origin, start 0, the size and the
  root: not the extension lines); the line carries ``u64 T || ML-DSA-44 signature``.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

from ..errors import MalformedInput, VerificationError
from .note import (
    COSIGNATURE_HEADER,
    COSIGNATURE_MLDSA44,
    COSIGNATURE_V1,
    COSIGNER_TYPES,
    ED25519,
    MAX_TIMESTAMP,
    SIGNATURE_BYTES,
    SUBTREE_LABEL,
    Checkpoint,
    Note,
    NoteKey,
    NoteSignature,
    _check_name,
    _check_text,
    _raw,
    key_id,
    sign_note,
    verify_note_signature,
)


def cosignature_message(checkpoint_text: str, timestamp: int) -> bytes:
    """What a cosigner signs: ``cosignature/v1``, ``time T`` and the checkpoint's text."""
    if type(timestamp) is not int or not 0 <= timestamp <= MAX_TIMESTAMP:
        raise ValueError(f"a cosignature's timestamp is 0 to 2^63 - 1, not {timestamp!r}")
    return COSIGNATURE_HEADER + b"time %d\n" % timestamp + _check_text(checkpoint_text).encode("utf-8")


def subtree_message(checkpoint: Checkpoint, name: str, timestamp: int) -> bytes:
    """What an ML-DSA-44 cosigner signs for a checkpoint: tlog-cosignature's ``cosigned_message`` (the
    ``subtree/v1`` label, its name, the time, the origin, start 0, end the size, the root)."""
    if type(timestamp) is not int or not 0 <= timestamp <= MAX_TIMESTAMP:
        raise ValueError(f"a cosignature's timestamp is 0 to 2^63 - 1, not {timestamp!r}")
    who, origin = _check_name(name).encode("utf-8"), checkpoint.origin.encode("utf-8")
    if len(origin) > 255:
        raise MalformedInput("checkpoint: an ML-DSA-44 cosignature holds an origin of at most 255 bytes")
    return (SUBTREE_LABEL + bytes([len(who)]) + who + timestamp.to_bytes(8, "big") + bytes([len(origin)]) + origin
            + (0).to_bytes(8, "big") + checkpoint.size.to_bytes(8, "big") + checkpoint.root)


Cosigner = Ed25519PrivateKey | MLDSA44PrivateKey


def cosign(checkpoint_text: str, name: str, key: Cosigner, timestamp: int) -> NoteSignature:
    """A cosignature of a checkpoint at ``timestamp`` (POSIX seconds, never 0): cosignature/v1 by an
    Ed25519 key, the subtree/v1 message by an ML-DSA-44 key."""
    cp = Checkpoint.parse(checkpoint_text)  # a cosigner signs checkpoints, nothing else
    if type(timestamp) is not int or timestamp < 1:
        raise ValueError("a cosignature's timestamp is never 0")
    if isinstance(key, MLDSA44PrivateKey):
        public = key.public_key().public_bytes_raw()
        return NoteSignature(name, key_id(name, COSIGNATURE_MLDSA44, public),
                             timestamp.to_bytes(8, "big") + key.sign(subtree_message(cp, name, timestamp)))
    signature = key.sign(cosignature_message(checkpoint_text, timestamp))
    return NoteSignature(name, key_id(_check_name(name), COSIGNATURE_V1, _raw(key.public_key())),
                         timestamp.to_bytes(8, "big") + signature)


def cosigner_key(name: str, key: Cosigner) -> NoteKey:
    """The verifier key of a cosigner: type 0x04 for Ed25519, 0x06 for ML-DSA-44."""
    return NoteKey.of(name, key.public_key(), COSIGNATURE_V1)


WITNESS_NOTE_CONTEXT = b"witness/note/v1"  # an ML-DSA-44 witness's own notes: never a cosignature's message


def sign_as_witness(text: str, name: str, key: Cosigner) -> NoteSignature:
    """A witness's signature of a note of its own (its attempts count) with its cosigner key: Ed25519 as a
    type 0x01 note signature, ML-DSA-44 over the text (context ``witness/note/v1``) under its type 0x06
    key's name and ID; a verifier pinned to its cosigner key alone checks both (``verify_witness_note``)."""
    _check_text(text)
    if isinstance(key, MLDSA44PrivateKey):
        public = key.public_key().public_bytes_raw()
        return NoteSignature(_check_name(name), key_id(name, COSIGNATURE_MLDSA44, public),
                             key.sign(text.encode("utf-8"), WITNESS_NOTE_CONTEXT))
    return sign_note(text, name, key)


def verify_witness_note(note: Note, key: NoteKey) -> bool:
    """Whether the witness of cosigner key ``key`` signed ``note`` (``sign_as_witness``): False if it bears
    no line of it, ``VerificationError`` if one does not verify."""
    if key.alg == COSIGNATURE_V1:
        return verify_note_signature(note, NoteKey(key.name, ED25519, key.public))
    if key.alg != COSIGNATURE_MLDSA44:
        raise VerificationError(f"the key {key.name} is of type {key.alg:#04x}, not a witness's cosigner key")
    mine = note.of_key(key)
    for sig in mine:
        try:
            key.mldsa44().verify(sig.sig, note.text.encode("utf-8"), WITNESS_NOTE_CONTEXT)
        except InvalidSignature:
            raise VerificationError(f"the signature of {key.name}+{key.id.hex()} on the note does not verify",
                                    check="note") from None
    return bool(mine)


def cosignature_timestamp(sig: NoteSignature) -> int:
    """The timestamp a cosignature line carries (not verified: ``verify_cosignature`` does that)."""
    if len(sig.sig) not in (8 + n for n in SIGNATURE_BYTES.values()):
        raise VerificationError(f"the cosignature of {sig.name} is not a timestamp and an Ed25519 or ML-DSA-44 "
                                "signature")
    return int.from_bytes(sig.sig[:8], "big")


def verify_cosignature(checkpoint_text: str, sig: NoteSignature, key: NoteKey) -> int:
    """The timestamp of ``sig``, a cosignature by ``key`` (type 0x04 or 0x06) of the checkpoint; else
    ``VerificationError``."""
    if key.alg not in COSIGNER_TYPES:
        raise VerificationError(f"the key {key.name} is of type {key.alg:#04x}, not a cosigner key (0x04 or 0x06)")
    if sig.name != key.name or sig.key_id != key.id:
        raise VerificationError(f"the cosignature is by {sig.name}+{sig.key_id.hex()}, not by the witness "
                                f"{key.name}+{key.id.hex()}", check="cosignature")
    if len(sig.sig) != 8 + SIGNATURE_BYTES[key.alg]:
        raise VerificationError(f"the cosignature of {key.name} is not a timestamp and a type {key.alg:#04x} "
                                "signature", check="cosignature")
    timestamp = cosignature_timestamp(sig)
    if not 0 < timestamp <= MAX_TIMESTAMP:
        raise VerificationError(f"the cosignature of {key.name} has timestamp {timestamp}, outside 1 to 2^63 - 1",
                                check="cosignature")
    try:
        if key.alg == COSIGNATURE_MLDSA44:
            key.mldsa44().verify(sig.sig[8:], subtree_message(Checkpoint.parse(checkpoint_text), key.name, timestamp))
        else:
            key.ed25519().verify(sig.sig[8:], cosignature_message(checkpoint_text, timestamp))
    except InvalidSignature:
        raise VerificationError(f"the cosignature of {key.name} does not verify for this checkpoint",
                                check="cosignature") from None
    return timestamp
