"""The beacon's logic: check a streamed head, refuse and keep equivocation, sign fresh randomness.

A head is stamped only if the run's own key signed it and it extends the last head stamped for the
run (an RFC 6962 consistency proof); the first head of a run comes with its manifest (whose key
signs every later head) and a proof that it extends the manifest's one-leaf log. The beta of each
statement is drawn here, after the head reached the beacon, from the operating system's CSPRNG.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..commit.beacon import BETA_BYTES, BeaconStatement, recipe_id, run_id
from ..commit.hashing import canonical_json, from_hex, parse_canonical_json, same, text_problem
from ..commit.merkle import verify_consistency
from ..commit.signing import SignedTreeHead, public_hex, public_key_from_hex
from ..errors import VerificationError
from .db import BeaconEvidence, BeaconHead, BeaconRun

MAX_CONSISTENCY_HASHES = 64
MAX_MANIFEST_BYTES = 1 << 20
MAX_EXTENSIONS_BYTES = 1 << 16  # a final head's extensions are a few hashes and counts
MAX_HEAD_SIZE = 2**31 - 1  # the tables' sizes are 32-bit integers (two billion records: no run comes near)
RUNS_PAGE = 100  # runs a list returns at most, unless it asks for fewer
FINAL_EXTENSION = "final_state_hash"  # a run's last head states its final state in its extensions


class BeaconRefused(Exception):
    """A refused head: an HTTP status and a message for the trainer."""

    def __init__(self, status: int, message: str, evidence: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.evidence = status, message, evidence


def fresh_beta(prev_size: int, size: int) -> bytes:
    """32 bytes from the operating system's CSPRNG (the window's sizes play no part)."""
    return os.urandom(BETA_BYTES)


def now_ms() -> int:
    """The beacon's clock, in milliseconds."""
    return int(time.time() * 1000)


@dataclass
class Beacon:
    """Stamps heads with signed statements, keeping everything in the database ``sessions`` open."""

    key: Ed25519PrivateKey
    # where beta comes from, given the window's sizes (a test fixes it to steer the draw)
    draw: Callable[[int, int], bytes] = field(default=fresh_beta)

    @property
    def public_key(self) -> str:
        """The key its statements are signed with (hex)."""
        return public_hex(self.key.public_key())

    def stamp(self, s: Session, tree_head: object, consistency: object = (), manifest: str | None = None,
              run: str | None = None, account: str | None = None, attempts: int = 0) -> BeaconStatement:
        """Check ``tree_head`` and answer it with a signed statement (the same one again for a head
        already stamped). ``account`` names who streams the run, where the caller knows it (a
        leaderboard), and ``attempts`` is the caller's own count of that account's other attempts
        (its runs that were not certified): a final statement prices them in. Raises ``BeaconRefused``."""
        try:
            head = SignedTreeHead.from_json(tree_head)
            proof = self._proof(consistency)
        except (VerificationError, ValueError) as e:
            raise BeaconRefused(400, f"tree head refused: {e}") from None
        # every number and every text is checked before it reaches the database
        if not 1 <= head.size <= MAX_HEAD_SIZE:
            raise BeaconRefused(400, f"tree_head.size: {head.size} is not a size this beacon stamps (1 to "
                                     f"{MAX_HEAD_SIZE})")
        if head.extensions is not None:
            check_text(head.extensions, "tree_head.extensions")
            if len(canonical_json(head.extensions)) > MAX_EXTENSIONS_BYTES:  # kept with the head, and served
                raise BeaconRefused(400, f"tree_head.extensions: over {MAX_EXTENSIONS_BYTES} bytes")
        row = self._run(s, head, proof, manifest, run)
        if row is None:  # a new run, its first head checked against its manifest
            return self._new_run(s, head, proof, manifest, account, attempts)  # type: ignore[arg-type]
        if row.account != account:
            # a run first streamed by someone else (or around the leaderboard, to its beacon's own
            # routes) has draws its trainer may have seen: none of them is an account's
            raise BeaconRefused(409, f"run {row.run[:16]}… was first streamed to this beacon "
                                     + ("outside the leaderboard" if row.account is None else "by another account"))
        return self._extend(s, row, head, proof, attempts)

    @staticmethod
    def _proof(consistency: object) -> list[bytes]:
        if not isinstance(consistency, (list, tuple)) or len(consistency) > MAX_CONSISTENCY_HASHES:
            raise ValueError(f"consistency must be a list of at most {MAX_CONSISTENCY_HASHES} hex hashes")
        return [from_hex(h, "consistency hash") for h in consistency]

    def _run(self, s: Session, head: SignedTreeHead, proof: list[bytes], manifest: str | None,
             run: str | None) -> BeaconRun | None:
        if manifest is not None:
            if not isinstance(manifest, str) or len(manifest) > MAX_MANIFEST_BYTES:
                raise BeaconRefused(400, "manifest: the manifest must be its log line, at most 1 MiB")
            check_text(manifest, "manifest")
            run = run_id(manifest.encode()).hex()
        if not isinstance(run, str):
            raise BeaconRefused(400, "run: a head comes with its run (or, the first time, with its manifest)")
        if not is_run_name(run):
            raise BeaconRefused(400, "run: a run is named by 64 lowercase hex digits (its manifest's leaf hash)")
        found = s.scalar(select(BeaconRun).where(BeaconRun.run == run))
        if found is None and manifest is None:
            raise BeaconRefused(404, f"this beacon has answered for no run {run[:64]!r}: send the first head with "
                                     "its manifest")
        return found

    def _new_run(self, s: Session, head: SignedTreeHead, proof: list[bytes], manifest: str,
                 account: str | None, attempts: int) -> BeaconStatement:
        m = read_manifest(manifest)
        try:
            head.verify(m.public)
            verify_consistency(1, head.size, bytes.fromhex(m.run), head.root, proof)
        except VerificationError as e:
            raise BeaconRefused(400, f"tree head refused: {e}") from None
        t = now_ms()
        row = BeaconRun(run=m.run, public_key=m.public_key, manifest=manifest, first_ms=t, last_ms=t,
                        last_size=0, last_root="", final=False, equivocated=False, recipe=m.recipe, seed=m.seed,
                        account=account)
        s.add(row)
        try:
            s.flush()
        except IntegrityError:  # the same first head raced in twice: answer as for a known run
            s.rollback()
            known = s.scalar(select(BeaconRun).where(BeaconRun.run == m.run))
            assert known is not None
            if known.account != account:
                raise BeaconRefused(409, f"run {known.run[:16]}… was first streamed to this beacon by another "
                                         "client") from None
            return self._extend(s, known, head, proof, attempts)
        return self._answer(s, row, head, t, attempts)

    def _extend(self, s: Session, row: BeaconRun, head: SignedTreeHead, proof: list[bytes],
                attempts: int = 0) -> BeaconStatement:
        try:
            head.verify(public_key_from_hex(row.public_key))
        except VerificationError as e:
            raise BeaconRefused(400, f"tree head refused: {e}") from None
        stamped = s.scalar(select(BeaconHead).where(BeaconHead.run_id == row.id, BeaconHead.size == head.size))
        if stamped is not None:
            if same(bytes.fromhex(stamped.root), head.root):
                return BeaconStatement.from_json(json.loads(stamped.statement_json))  # the same head again
            return self._equivocation(s, row, stamped, head)
        if row.equivocated:
            raise BeaconRefused(409, f"run {row.run[:16]}… equivocated: this beacon stamps none of its heads")
        if row.final:
            raise BeaconRefused(409, f"run {row.run[:16]}… ended with its head of size {row.last_size}")
        if head.size < row.last_size:
            raise BeaconRefused(409, f"a head of size {head.size} is older than the last one stamped for the run "
                                     f"({row.last_size})")
        try:
            verify_consistency(row.last_size, head.size, bytes.fromhex(row.last_root), head.root, proof)
        except VerificationError as e:
            raise BeaconRefused(400, f"the tree head does not extend the last one stamped for the run "
                                     f"(size {row.last_size}): {e}") from None
        return self._answer(s, row, head, now_ms(), attempts)

    def _answer(self, s: Session, row: BeaconRun, head: SignedTreeHead, t: int, attempts: int = 0) -> BeaconStatement:
        """Stamp ``head`` as the run's next window, once: the check of the last stamped size and its
        update are one conditional UPDATE, so of parallel heads that extend one stamped head exactly
        one is answered (a draw per window); the others are refused."""
        prev_size, prev_root = row.last_size, row.last_root
        final = head.extensions is not None and FINAL_EXTENSION in head.extensions
        won = s.execute(update(BeaconRun)
                        .where(BeaconRun.id == row.id, BeaconRun.last_size == prev_size,
                               BeaconRun.last_root == prev_root, BeaconRun.final.is_(False),
                               BeaconRun.equivocated.is_(False))
                        .values(last_size=head.size, last_root=head.root.hex(), last_ms=t, final=final)
                        .execution_options(synchronize_session=False)).rowcount
        if won != 1:
            s.rollback()
            return self._lost(s, row, head, prev_size)
        others = priced = None
        if final:  # counted under the run's row lock, with every attempt first seen before this head
            others, priced = self._linked(s, row)
            priced += attempts
        statement = BeaconStatement(self.public_key, bytes.fromhex(row.run), head.size, head.root, prev_size,
                                    self.draw(prev_size, head.size), t, final, others=others,
                                    attempts=priced).signed(self.key)
        s.add(BeaconHead(run_id=row.id, size=head.size, root=head.root.hex(), prev_size=prev_size,
                         head_json=canonical_json(head.to_json()).decode(),
                         statement_json=canonical_json(statement.to_json()).decode(), received_ms=t))
        try:
            s.commit()
        except IntegrityError:  # a unique (run, size) or (run, prev_size) row beat it: the refusal says which
            s.rollback()
            return self._lost(s, row, head, prev_size)
        s.expire(row)  # its columns changed in the database, not in this object: never flushed back
        return statement

    def _lost(self, s: Session, row: BeaconRun, head: SignedTreeHead, prev_size: int) -> BeaconStatement:
        """A head that another request overtook: the statement of the same head if that is what was
        stamped (a repeat), else a refusal (its window was drawn for another head)."""
        stamped = s.scalar(select(BeaconHead).where(BeaconHead.run_id == row.id, BeaconHead.size == head.size))
        if stamped is not None:
            if same(bytes.fromhex(stamped.root), head.root):
                return BeaconStatement.from_json(json.loads(stamped.statement_json))
            return self._equivocation(s, row, stamped, head)  # raced in with another root: a fork, kept
        now = s.scalar(select(BeaconRun.last_size).where(BeaconRun.id == row.id))
        raise BeaconRefused(409, f"another head of run {row.run[:16]}… was stamped while this one (size {head.size}) "
                                 f"was checked: the window after size {prev_size} is drawn once, and the run's last "
                                 f"stamped head is now of size {now}; send heads in order, one at a time")

    def _linked(self, s: Session, row: BeaconRun) -> tuple[int, int]:
        """How many other runs this beacon linked to this one, and how many of them it prices in.

        Linked (reported): the same signing key, recipe, run seed or account. Priced: every run with
        the same run seed, whatever its recipe, key or name, finished or not. The seed fixes the
        initial weights and the data order; a recipe field that changes no bit of the training (a
        clipping threshold never reached) is free to vary, so "another recipe" need not be another
        computation, and a "final" head costs nothing to sign. The seed is the trainer's secret until
        its first head, so no one else can add such a run. A run under another seed trains from
        other weights on another order: another computation, paid for up to its bad steps (a
        leaderboard prices its account's uncertified runs itself: ``attempts``)."""
        links = [BeaconRun.public_key == row.public_key, BeaconRun.recipe == row.recipe, BeaconRun.seed == row.seed]
        if row.account is not None:
            links.append(BeaconRun.account == row.account)
        others = s.scalar(select(func.count()).select_from(BeaconRun).where(BeaconRun.id != row.id, or_(*links)))
        priced = s.scalar(select(func.count()).select_from(BeaconRun).where(
            BeaconRun.id != row.id, BeaconRun.seed == row.seed))
        return int(others or 0), int(priced or 0)

    def _equivocation(self, s: Session, row: BeaconRun, stamped: BeaconHead, other: SignedTreeHead) -> BeaconStatement:
        evidence = {"run": row.run, "size": other.size, "stamped": json.loads(stamped.head_json),
                    "other": other.to_json()}
        # one fork proves it: a run already caught keeps that proof and adds none (each further fork
        # would grow the beacon's tables, and its public answers, at the forger's pace)
        kept = s.scalar(select(func.count()).select_from(BeaconEvidence).where(BeaconEvidence.run_id == row.id))
        if not kept:
            s.add(BeaconEvidence(run_id=row.id, size=other.size, stamped_json=stamped.head_json,
                                 other_json=canonical_json(other.to_json()).decode(), received_ms=now_ms()))
        row.equivocated = True
        s.commit()
        raise BeaconRefused(409, f"equivocation: the run's key signed two heads of size {other.size} with different "
                                 "roots; both are kept as proof and the run is refused", evidence)

    # --- what anyone may read -------------------------------------------------------------
    def runs(self, s: Session, limit: int = RUNS_PAGE, offset: int = 0) -> list[dict]:
        """The runs this beacon answered for, newest first, with their last heads and whether they
        ended: at most ``limit`` of them, after the first ``offset``."""
        rows = s.scalars(select(BeaconRun).order_by(BeaconRun.first_ms.desc(), BeaconRun.id.desc())
                         .offset(offset).limit(limit))
        return [run_json(r) for r in rows]

    def statement_at(self, s: Session, run: str, size: int) -> dict | None:
        """The statement this beacon signed for a run's head of ``size`` records, or None."""
        row = s.scalar(select(BeaconRun).where(BeaconRun.run == run)) if is_run_name(run) else None
        head = s.scalar(select(BeaconHead).where(BeaconHead.run_id == row.id, BeaconHead.size == size)) \
            if row is not None else None
        return json.loads(head.statement_json) if head is not None else None

    def run(self, s: Session, run: str) -> dict:
        """One run: its statements in order and any evidence of equivocation."""
        row = s.scalar(select(BeaconRun).where(BeaconRun.run == run)) if is_run_name(run) else None
        if row is None:
            raise BeaconRefused(404, f"this beacon has answered for no run {str(run)[:64]!r}")
        heads = s.scalars(select(BeaconHead).where(BeaconHead.run_id == row.id).order_by(BeaconHead.size))
        evidence = s.scalars(select(BeaconEvidence).where(BeaconEvidence.run_id == row.id).order_by(BeaconEvidence.id))
        return run_json(row) | {
            "statements": [json.loads(h.statement_json) for h in heads],
            "evidence": [{"size": e.size, "stamped": json.loads(e.stamped_json), "other": json.loads(e.other_json)}
                         for e in evidence],
        }


@dataclass(frozen=True)
class RunManifest:
    """What a beacon or a witness takes from a run's manifest: its name, key and what links attempts."""

    run: str  # the manifest's leaf hash (hex)
    public_key: str  # the run's key (hex), which signs its every head
    public: Ed25519PublicKey
    recipe: str
    seed: str | None  # the run seed in its one spelling, if the manifest has one


def read_manifest(manifest: object) -> RunManifest:
    """Check a run's manifest, given as its log line (text, at most 1 MiB, canonical JSON, a key that
    is no weak one); else ``BeaconRefused`` (400, saying what is wrong)."""
    if not isinstance(manifest, str) or len(manifest) > MAX_MANIFEST_BYTES:
        raise BeaconRefused(400, "manifest: the manifest must be its log line, at most 1 MiB")
    check_text(manifest, "manifest")
    line = manifest.encode()
    try:
        m = parse_canonical_json(line)
    except ValueError as e:
        raise BeaconRefused(400, f"manifest: {e}") from None
    if not isinstance(m, dict) or m.get("type") != "manifest":
        raise BeaconRefused(400, "the log's first record is not a manifest")
    try:
        public = public_key_from_hex(m.get("public_key"))
    except VerificationError as e:
        raise BeaconRefused(400, f"manifest: public_key: {e}") from None
    try:
        recipe = recipe_id(m).hex()
    except (ValueError, UnicodeError) as e:
        raise BeaconRefused(400, f"manifest: {e}") from None
    try:  # in its one spelling: a run a verifier accepts has one (a manifest without is no attempt at it)
        seed = from_hex(m.get("run_seed"), "run_seed", 32).hex()
    except (ValueError, TypeError):
        seed = None
    return RunManifest(run_id(line).hex(), m["public_key"], public, recipe, seed)


def is_run_name(run: object) -> bool:
    """A run's name as the beacon keeps it: 64 lowercase hex digits."""
    return isinstance(run, str) and len(run) == 64 and all(c in "0123456789abcdef" for c in run)


def check_text(value: object, field: str) -> None:
    """Refuse (400, naming ``field``) a text that the databases cannot keep: a lone surrogate (no
    UTF-8 spells it) or a NUL (PostgreSQL's text has none), in a string or a JSON value's keys and strings."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem:
            raise BeaconRefused(400, f"{field}: {problem}")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, field)
            check_text(v, f"{field}.{k}" if isinstance(k, str) and k.isidentifier() else field)
    elif isinstance(value, list):
        for v in value:
            check_text(v, field)


def run_json(r: BeaconRun) -> dict:
    """A run's public summary (its ``recipe`` too: who trained one recipe how often; never its seed)."""
    return {"run": r.run, "public_key": r.public_key, "recipe": r.recipe, "first_ms": r.first_ms,
            "last_ms": r.last_ms, "last_size": r.last_size, "final": r.final, "equivocated": r.equivocated}
