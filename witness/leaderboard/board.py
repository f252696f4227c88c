"""The board's own history: every decision the server signs (a run certified, rejected or revoked) is
an entry of one append-only log, RFC 6962's Merkle tree over its entries, whose checkpoints the server
signs as C2SP signed notes (origin ``witness.board/<first 32 hex of the server key>``).

A reader keeps the checkpoint it saw last. Any later one must be consistent with it (a consistency
proof from ``GET /api/board/consistency``), and the entries must rebuild its root: an entry edited or
removed after a reader saw it, or a decision listed and then taken back without a revocation entry,
shows as a checkpoint that is not consistent with the kept one (``check_board``).
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from ..commit.hashing import canonical_json, leaf_hash, same, sha256
from ..commit.merkle import MerkleTree, verify_consistency
from ..commit.note import Checkpoint, Note, NoteKey, parse_note, sign_note, verify_note_signature
from ..errors import MalformedInput, VerificationError
from .db import BoardEntry, Run, now_ms

PAGE = 1000  # entries a request reads at most


def board_origin(public_key: str) -> str:
    """The board log's origin: named by the server's key (hex), so two servers never share one."""
    return f"witness.board/{public_key[:32]}"


def board_key(public_key: str) -> NoteKey:
    """The note key a reader checks the board's checkpoints with (the server's Ed25519 key)."""
    return NoteKey(board_origin(public_key), 0x01, bytes.fromhex(public_key))


def append_decision(s: Session, run: Run, envelope_text: str) -> int:
    """Append the run's decision (in the caller's transaction): its status, bound and the SHA-256 of the
    signed decision it was published as. The index of the entry."""
    # one writer at a time: an entry's index is the number written before it (the table's own lock on
    # PostgreSQL, taken by no other path; SQLite's database-wide write lock)
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("LOCK TABLE board_entries IN SHARE ROW EXCLUSIVE MODE"))
    else:
        s.execute(text("UPDATE board_entries SET made_ms = made_ms WHERE 0"))
    index = int(s.scalar(select(func.count()).select_from(BoardEntry)) or 0)
    entry = {"type": "decision", "run": run.id, "track": run.track, "decision": run.status, "bound": run.bound,
             "metric_value": run.metric_value, "decision_sha256": sha256(envelope_text.encode()).hex()}
    s.add(BoardEntry(index=index, entry=canonical_json(entry).decode(), made_ms=now_ms()))
    s.flush()
    return index


def tree(s: Session) -> MerkleTree:
    """The tree of every entry written."""
    return MerkleTree([leaf_hash(e.encode()) for e in s.scalars(select(BoardEntry.entry).order_by(BoardEntry.index))])


def checkpoint(s: Session, key: Ed25519PrivateKey, public_key: str) -> str:
    """The latest checkpoint, signed by the server (a signed note)."""
    t = tree(s)
    text = Checkpoint(board_origin(public_key), t.size, t.root()).text()
    return Note(text, (sign_note(text, board_origin(public_key), key),)).encode().decode()


def entries(s: Session, start: int, count: int = PAGE) -> list[str]:
    """Entries from ``start``, at most ``count`` (and ``PAGE``), as canonical JSON text."""
    return list(s.scalars(select(BoardEntry.entry).where(BoardEntry.index >= start,
                                                         BoardEntry.index < start + min(count, PAGE))
                          .order_by(BoardEntry.index)))


def consistency(s: Session, old: int, new: int) -> list[str]:
    """A consistency proof between two sizes of the log (hex)."""
    t = tree(s)
    if not 0 < old <= new <= t.size:
        raise ValueError(f"no consistency proof from {old} to {new} in a log of {t.size}")
    return [h.hex() for h in t.consistency_proof(old, new)] if old < new else []


def check_board(note: bytes, all_entries: list[bytes], key: NoteKey, kept: bytes | None = None,
                proof: list[bytes] = ()) -> Checkpoint:
    """Check the board's checkpoint ``note``: signed by ``key``, its root rebuilt from ``all_entries``,
    and (``kept``: a checkpoint seen before) consistent with that one through ``proof``. Returns it;
    ``VerificationError`` saying what does not hold."""
    try:
        parsed = parse_note(note)
        cp = Checkpoint.parse(parsed.text)
    except (MalformedInput, ValueError) as e:
        raise VerificationError(f"the board's checkpoint: {e}") from None
    if cp.origin != key.name or not verify_note_signature(parsed, key):
        raise VerificationError("the board's checkpoint is not signed by the server's key")
    if len(all_entries) != cp.size or not same(MerkleTree([leaf_hash(e) for e in all_entries]).root(), cp.root):
        raise VerificationError(f"the board's {len(all_entries)} entries do not rebuild its checkpoint of size {cp.size}")
    if kept is not None:
        old = Checkpoint.parse(parse_note(kept).text)
        if old.origin != cp.origin or old.size > cp.size:
            raise VerificationError(f"the board's checkpoint of size {cp.size} is older than the kept one ({old.size})")
        if old.size == cp.size and not same(old.root, cp.root):
            raise VerificationError(f"the board signed two histories of size {cp.size}: an entry was edited or removed")
        if 0 < old.size < cp.size:
            try:
                verify_consistency(old.size, cp.size, old.root, cp.root, list(proof))
            except VerificationError:
                raise VerificationError(f"the board's history of size {cp.size} does not extend the kept one of size "
                                        f"{old.size}: an entry was edited or removed") from None
    return cp


def fetch_and_check(client, public_key: str, kept: bytes | None = None) -> tuple[bytes, Checkpoint]:  # noqa: ANN001 - an httpx.Client
    """Read the board's checkpoint and every entry through ``client`` (the leaderboard's address), and
    check them (``check_board``) against the server's key and the ``kept`` checkpoint; the note and it."""
    def get(path: str, **params) -> object:  # noqa: ANN003
        resp = client.get(path, params=params)
        if resp.status_code != 200:
            raise VerificationError(f"the board answered {path} with {resp.status_code}")
        return resp.content if path.endswith("checkpoint") else resp.json()

    note = get("/api/board/checkpoint")
    size = Checkpoint.parse(parse_note(note).text).size
    got: list[bytes] = []
    while len(got) < size:
        page = get("/api/board/entries", start=len(got))["entries"]  # type: ignore[index]
        if not page:
            raise VerificationError(f"the board served {len(got)} of the {size} entries its checkpoint holds")
        got += [e.encode() for e in page[:size - len(got)]]
    proof: list[bytes] = []
    if kept is not None:
        old = Checkpoint.parse(parse_note(kept).text).size
        if 0 < old < size:
            proof = [bytes.fromhex(h) for h in get("/api/board/consistency", old=old, new=size)["proof"]]  # type: ignore[index]
    return note, check_board(note, got, board_key(public_key), kept, proof)  # type: ignore[arg-type]
