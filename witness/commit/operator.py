"""An operator's log: one long-lived C2SP log whose entries are many runs' registrations and heads.

Public witnesses are configured with a log once and never learn one from a request, so a lab, a
leaderboard or a trainer runs one log for all its runs, under one origin and one key, and the
witnesses cosign its checkpoints. Its entries are RFC 6962 leaves of canonical JSON:

* ``{"public_key": <hex>, "run": <run id hex>, "seed_tag": <hex>, "type": "run"}``: a run, registered
  before its first head. The seed tag is ``SHA-256("witness/operator-seed-tag/v1" ‖ run seed ‖ run
  id)``: a verifier that knows a run's seed (its manifest's ``run_seed``) finds every other run of that
  seed in the log and prices it, while a reader who does not cannot link runs, and a stranger cannot
  register a run that counts against someone else's (the seed stays the trainer's secret: the
  manifest is not in the log).
* ``{"checkpoint": <the run's checkpoint, a signed note by the run's key>, "run": <run id hex>,
  "type": "head"}``: one of the run's heads, as its per-run log's checkpoint.

A window's draw is then fixed by a drand round after the operator checkpoint that holds the window's
head entry was cosigned; the verifier checks the entry's inclusion in that checkpoint, the witnesses'
cosignatures, and consistency between the operator checkpoints the bundle carries.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MalformedInput
from .beacon import run_id
from .hashing import canonical_json, from_hex, leaf_hash, parse_canonical_json, sha256
from .note import Checkpoint, Note, NoteKey, parse_note, run_origin

MAX_MANIFEST_BYTES = 1 << 20  # the beacon's and the witness's bound on a manifest line
MAX_HEAD_NOTE_BYTES = 1 << 14  # a run's checkpoint: its three lines and the run key's signature
MAX_ENTRY_BYTES = 2 * MAX_HEAD_NOTE_BYTES + (1 << 10)  # a head entry: its note, escaped in JSON


SEED_TAG_DOMAIN = b"witness/operator-seed-tag/v1\x00"


def seed_tag(seed: bytes, run: bytes) -> bytes:
    """A run's seed tag: whoever knows the seed can tell a run of it by its id; no one else can."""
    return sha256(SEED_TAG_DOMAIN + seed + run)


@dataclass(frozen=True)
class RunEntry:
    """A run registered in an operator's log: its id, its key and its seed tag (None: a manifest without
    a run seed, which no verifier presents)."""

    run: bytes
    public_key: bytes
    seed_tag: bytes | None

    def entry(self) -> bytes:
        """The entry's bytes (the log's leaf is their RFC 6962 leaf hash)."""
        return canonical_json({"public_key": self.public_key.hex(), "run": self.run.hex(),
                               "seed_tag": self.seed_tag.hex() if self.seed_tag else None, "type": "run"})


@dataclass(frozen=True)
class HeadEntry:
    """One of a run's heads in an operator's log: its checkpoint, signed by the run's key."""

    run: bytes
    note: bytes
    checkpoint: Checkpoint

    def entry(self) -> bytes:
        """The entry's bytes."""
        return canonical_json({"checkpoint": self.note.decode("utf-8"), "run": self.run.hex(), "type": "head"})

    def verify(self, public_key: bytes) -> None:
        """``MalformedInput``/``VerificationError`` unless the run's key (``public_key``, raw Ed25519) signed it."""
        from .note import ED25519, verify_note_signature

        key = NoteKey(run_origin(self.run), ED25519, public_key)
        if not verify_note_signature(parse_note(self.note, MAX_HEAD_NOTE_BYTES), key):
            raise MalformedInput("a head entry's checkpoint carries no signature of the run's key")


def run_entry(manifest_line: bytes) -> RunEntry:
    """A run's registration from its manifest line (canonical JSON of type manifest, with a public key)."""
    m = _json(manifest_line, MAX_MANIFEST_BYTES, "manifest")
    if not isinstance(m, dict) or m.get("type") != "manifest":
        raise MalformedInput("a run entry holds a manifest (a log's first record)")
    public = _hex32(m.get("public_key"), "manifest public_key")
    run = run_id(manifest_line)
    try:  # a manifest without a run seed in its one spelling is no attempt at a seeded run
        seed: bytes | None = from_hex(m.get("run_seed"), "run_seed", 32)
    except (ValueError, TypeError):
        seed = None
    return RunEntry(run, public, seed_tag(seed, run) if seed is not None else None)


def _json(raw: bytes, limit: int, what: str) -> object:
    """Canonical JSON of at most ``limit`` bytes, else ``MalformedInput`` naming ``what``."""
    if not isinstance(raw, bytes) or len(raw) > limit:
        raise MalformedInput(f"{what}: bytes, at most {limit}")
    try:
        return parse_canonical_json(raw)
    except ValueError as e:
        raise MalformedInput(f"{what}: {e}") from None


def _hex32(value: object, what: str) -> bytes:
    try:
        return from_hex(value, what, 32)
    except ValueError as e:
        raise MalformedInput(str(e)) from None


def head_entry(run: bytes, note: bytes) -> HeadEntry:
    """A run's head from its checkpoint note (the origin must be the run's; the signature is checked by
    ``HeadEntry.verify`` against the run's registered key)."""
    if not isinstance(run, bytes) or len(run) != 32:
        raise MalformedInput("a head entry names its run by its 32-byte id")
    parsed: Note = parse_note(note, MAX_HEAD_NOTE_BYTES)
    cp = Checkpoint.parse(parsed.text)
    if cp.origin != run_origin(run) or cp.extensions:
        raise MalformedInput("a head entry holds its run's checkpoint (the run's origin, no extension lines)")
    return HeadEntry(run, note, cp)


def parse_entry(raw: bytes) -> RunEntry | HeadEntry:
    """Strictly parse an operator log's entry (canonical JSON of exactly its fields)."""
    obj = _json(raw, MAX_ENTRY_BYTES, "entry")
    if isinstance(obj, dict) and set(obj) == {"public_key", "run", "seed_tag", "type"} and obj["type"] == "run":
        tag = obj["seed_tag"]
        return RunEntry(_hex32(obj["run"], "entry run"), _hex32(obj["public_key"], "entry public_key"),
                        None if tag is None else _hex32(tag, "entry seed_tag"))
    if isinstance(obj, dict) and set(obj) == {"checkpoint", "run", "type"} and obj["type"] == "head" \
            and isinstance(obj["checkpoint"], str):
        return head_entry(_hex32(obj["run"], "entry run"), obj["checkpoint"].encode("utf-8"))
    raise MalformedInput("an operator log's entry is a run's registration or one of its heads")


def entry_leaf(raw: bytes) -> bytes:
    """The entry's leaf hash in the operator's log."""
    return leaf_hash(raw)
