"""The strict bundle reader: bounded sizes, no links, no unknown files, only the signed prefix."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..commit.hashing import parse_canonical_json, same, sha256
from ..commit.log import RunLog
from ..commit.merkle import verify_consistency
from ..commit.signing import SignedTreeHead, public_key_from_hex
from ..errors import MalformedInput, VerificationError
from .layout import (
    CHECKPOINTS,
    COSIGNED,
    HEADS,
    LEAVES,
    LOG,
    MARKER,
    MAX_FILES,
    MAX_HEADS_BYTES,
    MAX_LOG_BYTES,
    MAX_PROBES_BYTES,
    MAX_RECORD_BYTES,
    MAX_SAFETENSORS_HEADER,
    MAX_STATEMENTS_BYTES,
    ONLINE,
    ONLINE_CHUNKS,
    ONLINE_SAMPLES,
    ONLINE_STATES,
    PROBES,
    STATEMENTS,
    checkpoint_step,
    due,
    marker_bytes,
    online_file,
    online_shard,
    partial_write,
)
from .schema import HEAD_EXTENSION_FIELDS, EndRecord, Manifest, StepRecord

PICKLE_SUFFIXES = {".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt"}


@dataclass
class Bundle:
    """A parsed bundle: everything here is covered by the last signed tree head."""

    root: Path
    manifest: Manifest
    steps: list[StepRecord]
    end: EndRecord | None
    log: RunLog
    heads: list[SignedTreeHead]
    checkpoints: dict[int, Path]
    notes: list[str] = field(default_factory=list)
    leaves: Path | None = None  # the dataset's leaves file, if the bundle carries one (read when checked)
    # online challenges: the beacon's statements (read when checked) and the states and samples kept
    # for the steps they selected, by step
    statements: Path | None = None
    online_states: dict[int, Path] = field(default_factory=dict)
    online_samples: dict[int, Path] = field(default_factory=dict)
    # a chunked run's chunk openings, by the head size of the window they open (read when checked)
    online_chunks: dict[int, Path] = field(default_factory=dict)
    # committed checkpoints an online run left out (it is audited from its selected states)
    missing_checkpoints: list[int] = field(default_factory=list)
    probes: Path | None = None  # the probe inputs (read when checked)
    # a run over several ranks keeps each state as its ranks' shares of the rows: by step, by rank
    online_shards: dict[int, dict[int, Path]] = field(default_factory=dict)
    # leaves files already checked against the manifest's data root, by (path, document rule): the
    # check hashes every sample's leaf, and several steps of one audit need the leaves
    checked_leaves: dict = field(default_factory=dict, repr=False, compare=False)

    def held_states(self) -> list[int]:
        """Steps whose state the bundle holds as tensors (checkpoints and online states), ascending."""
        return sorted(set(self.checkpoints) | set(self.online_states) | set(self.online_shards))

    def read_probes(self) -> list[bytes] | None:
        """The probe inputs the bundle carries, checked against the manifest's ``probe_hash`` (None for
        a run recorded before bundles carried them)."""
        if self.probes is None:
            return None
        data = _read_bounded(self.probes, MAX_PROBES_BYTES, PROBES)
        if not same(sha256(data), self.manifest.probe_hash):
            raise VerificationError(f"{PROBES} is not the probe set the manifest commits (probe_hash)", check="manifest")
        try:
            items = parse_canonical_json(data)
            if not isinstance(items, list) or not items or not all(isinstance(h, str) for h in items):
                raise ValueError("not a list of hex strings")
            return [bytes.fromhex(h) for h in items]
        except ValueError as e:
            raise MalformedInput(f"{PROBES} is not a list of hex-encoded probes: {e}") from None

    def read_statements(self) -> list[bytes]:
        """The statement lines as the trainer received them (bounded; a torn last line is refused)."""
        if self.statements is None:
            return []
        data = _read_bounded(self.statements, statements_bound(self.manifest), STATEMENTS)
        lines, torn = _lines(data, STATEMENTS)
        if torn:
            raise MalformedInput(f"{STATEMENTS} is truncated: its last line is not complete")
        return lines

    @property
    def complete(self) -> bool:
        """Whether the run finished (its end record is signed)."""
        return self.end is not None

    @property
    def final_head(self) -> SignedTreeHead:
        """The last signed tree head."""
        return self.heads[-1]

    def checkpoint_steps(self) -> list[int]:
        """Steps with a committed checkpoint (state after that many updates), ascending."""
        return sorted(self.checkpoints)

    def committed_checkpoint(self, step: int) -> tuple[bytes, bytes] | None:
        """(state hash, file SHA-256) the log commits for the checkpoint after ``step`` updates, if any."""
        if step == 0:
            return self.manifest.init_state_hash, self.manifest.init_checkpoint_sha256
        rec = self.steps[step - 1]
        if rec.state_hash is None or rec.checkpoint_sha256 is None:
            return None
        return rec.state_hash, rec.checkpoint_sha256

    def committed_state(self, step: int) -> bytes | None:
        """The state hash the log commits for the state after ``step`` updates, if any."""
        return self.manifest.init_state_hash if step == 0 else self.steps[step - 1].state_hash

    def state_steps(self) -> list[int]:
        """Steps whose state (after that many updates) the log commits by its hash, ascending."""
        return [0] + [r.step + 1 for r in self.steps if r.state_hash is not None]


def looks_like_pickle(head: bytes) -> bool:
    """Whether a file's first 9 bytes open a pickle (protocol 2 to 5). A safetensors file whose
    header is 640 + 256k bytes long starts with the same two bytes (its little-endian length),
    so a file shaped like safetensors (a sane length, then '{') is not one: this is a friendly
    diagnosis only, since nothing in a bundle is ever unpickled."""
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    safetensors_shaped = len(head) >= 9 and int.from_bytes(head[:8], "little") <= MAX_SAFETENSORS_HEADER \
        and head[8:9] == b"{"
    return not safetensors_shaped


def _looks_like_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        return looks_like_pickle(f.read(9))


def _scan(root: Path) -> tuple[set[str], list[str]]:
    """Every regular file under ``root`` (relative names); links and devices are refused."""
    files: set[str] = set()
    temps: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise MalformedInput(f"{rel} is a link; a bundle may not point outside itself")
            if stat.S_ISDIR(st.st_mode):
                if rel not in (CHECKPOINTS, ONLINE, ONLINE_STATES, ONLINE_SAMPLES, ONLINE_CHUNKS):
                    raise MalformedInput(f"unexpected folder {rel} in the bundle")
                continue
            if not stat.S_ISREG(st.st_mode):
                raise MalformedInput(f"{rel} is not a regular file")
            if Path(name).suffix.lower() in PICKLE_SUFFIXES or _looks_like_pickle(full):
                raise MalformedInput(f"{rel} looks like a pickle; witness never unpickles anything")
            if partial_write(rel):
                temps.append(rel)
                continue
            if rel not in (MARKER, LOG, HEADS, LEAVES, PROBES, STATEMENTS, COSIGNED) and checkpoint_step(rel) is None \
                    and online_file(rel) is None and online_shard(rel) is None:
                raise MalformedInput(f"unexpected file {rel} in the bundle")
            files.add(rel)
            if len(files) > MAX_FILES:
                raise MalformedInput("too many files in the bundle")
    return files, temps


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise MalformedInput(f"{what} is {size} bytes, over the {limit}-byte limit")
    return path.read_bytes()


def _lines(data: bytes, what: str) -> tuple[list[bytes], bool]:
    """Complete lines, and whether a torn (unterminated) last line was dropped."""
    parts = data.split(b"\n")
    torn = parts[-1] != b""
    lines = parts[:-1]
    for i, line in enumerate(lines):
        if len(line) > MAX_RECORD_BYTES:
            raise MalformedInput(f"{what} line {i} is over {MAX_RECORD_BYTES} bytes")
    return lines, torn


def _json(line: bytes, where: str) -> object:
    try:
        return parse_canonical_json(line)
    except ValueError as e:
        raise MalformedInput(f"{where}: {e}") from None


def _pin(manifest: Manifest, public_key: str | None) -> None:
    if public_key is not None and public_key != manifest.public_key:
        raise VerificationError(
            f"the run is signed by {manifest.public_key[:16]}…, not by the pinned key {public_key[:16]}…",
            check="signature",
        )


def as_bundle(source: str | os.PathLike | Bundle, public_key: str | None = None) -> Bundle:
    """A bundle opened once and passed on (the key pin still applies), or open the folder."""
    if isinstance(source, Bundle):
        _pin(source.manifest, public_key)
        return source
    return open_bundle(source, public_key)


def open_bundle(path: str | os.PathLike, public_key: str | None = None) -> Bundle:
    """Read and authenticate a bundle; returns only what the last signed tree head covers.

    ``public_key`` pins the signer; without it the manifest's key is used (and reported).
    """
    root = Path(path)
    if not root.exists():
        raise MalformedInput(f"{root} does not exist")
    if root.is_symlink() or not root.is_dir():
        raise MalformedInput(f"{root} is not a bundle folder")
    files, temps = _scan(root)
    for need in (MARKER, LOG, HEADS):
        if need not in files:
            raise MalformedInput(f"the bundle has no {need}")
    marker = _read_bounded(root / MARKER, 4096, MARKER)
    if marker == marker_bytes(1):
        raise MalformedInput("this is a version 1 bundle (witness 0.1), whose interactive audit did not bind the "
                             "whole training state; this verifier reads version 2: record the run again")
    if marker != marker_bytes():
        raise MalformedInput(f"{MARKER} is not a witness bundle marker of a supported version")

    lines, torn_log = _lines(_read_bounded(root / LOG, MAX_LOG_BYTES, LOG), LOG)
    head_lines, torn_heads = _lines(_read_bounded(root / HEADS, MAX_HEADS_BYTES, HEADS), HEADS)
    if not lines:
        raise MalformedInput(f"{LOG} is {'truncated inside its first record' if torn_log else 'empty'}")
    if torn_heads:
        # Heads are written whole and fsynced; a torn one means the file was cut, not killed.
        raise MalformedInput(f"{HEADS} is truncated: its last line is not complete JSON")
    heads = [SignedTreeHead.from_json(_json(h, f"{HEADS} line {i}")) for i, h in enumerate(head_lines)]
    if not heads:
        raise MalformedInput("the bundle has no signed tree head; nothing in it is signed")

    manifest = Manifest.parse(_json(lines[0], "log record 0"))
    _pin(manifest, public_key)
    pub = public_key_from_hex(manifest.public_key)

    log = RunLog(lines)
    prev: SignedTreeHead | None = None
    for i, h in enumerate(heads):
        if h.size > len(lines) and torn_log:
            raise MalformedInput(f"{LOG} is truncated: it ends inside record {len(lines)}, "
                                 f"and tree head {i} covers {h.size} records")
        if h.size < 1 or h.size > len(lines):
            raise VerificationError(
                f"tree head {i} covers {h.size} records but the log holds {len(lines)}: records were dropped",
                check="log",
            )
        h.verify(pub)
        if h.root != log.root(h.size):
            raise VerificationError(
                f"the log's first {h.size} records do not hash to signed tree head {i}: "
                "a record was edited, dropped, inserted or reordered",
                check="log",
            )
        if prev is not None:
            if h.size < prev.size or h.timestamp_ms < prev.timestamp_ms:
                raise VerificationError(f"tree head {i} goes back in size or time", check="log")
            verify_consistency(prev.size, h.size, prev.root, h.root, log.tree.consistency_proof(prev.size, h.size))
        prev = h

    signed = heads[-1].size
    notes: list[str] = []
    steps: list[StepRecord] = []
    end: EndRecord | None = None
    for i in range(1, signed):
        obj = _json(lines[i], f"log record {i}")
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "end":
            if i != signed - 1:
                raise VerificationError(f"log record {i} ends the run but records follow it", check="log")
            end = EndRecord.parse(obj, f"log record {i}")
            continue
        rec = StepRecord.parse(obj, f"log record {i}")
        if rec.step != i - 1:
            raise VerificationError(
                f"log record {i} is step {rec.step}, expected step {i - 1}: steps were dropped or reordered",
                step=i - 1,
                check="log",
            )
        steps.append(rec)
    tail = len(lines) - signed
    if end is not None and (tail or torn_log or temps):
        raise MalformedInput("a finished bundle holds records or files after its final signed tree head")
    if tail or torn_log:
        notes.append(f"ignored {tail} unsigned trailing record(s){' and a torn line' if torn_log else ''}")
    for i, h in enumerate(heads):
        wanted = None
        if end is not None and i == len(heads) - 1:
            wanted = {k: end.raw[k] for k in HEAD_EXTENSION_FIELDS if k in end.raw}
        if h.extensions != wanted:
            raise VerificationError(f"tree head {i}'s extensions are not the run's used-data commitments", check="log")
    if end is not None and end.steps != len(steps):
        raise VerificationError(f"the end record claims {end.steps} steps; the log holds {len(steps)}", check="log")

    committed = {0}
    for rec in steps:
        # The manifest fixes which states are committed by hash and which are checkpointed:
        # a trainer may not leave out (or add) a commitment where it suits it.
        for value, every, what in ((rec.state_hash, manifest.state_every, "state hash"),
                                   (rec.checkpoint_sha256, manifest.checkpoint_every, "checkpoint")):
            wanted = due(rec.step, every, manifest.steps_planned)
            if (value is not None) != wanted:
                raise VerificationError(
                    f"the record {'lacks' if wanted else 'adds'} a {what}: the manifest commits one "
                    f"every {every} steps and after the last", step=rec.step, check="record")
        rooted = manifest.chunked and not manifest.tree
        if (rec.param_root is not None) != rooted:
            raise VerificationError(f"the record {'lacks' if rooted else 'adds'} a param_root: the manifest commits "
                                    "one at every step of a run whose online windows open its parameters' chunks in "
                                    "a chunk tree of their own (version 3), and none otherwise", step=rec.step,
                                    check="record")
        if (rec.state_leaves is not None) != manifest.tree:
            raise VerificationError(f"the record {'lacks' if manifest.tree else 'adds'} state_leaves: the manifest "
                                    "commits them at every step of a run whose chunks open into its state hash "
                                    "(version 4), and none otherwise", step=rec.step, check="record")
        if rec.checkpoint_sha256 is not None:
            committed.add(rec.step + 1)
    checkpoints: dict[int, Path] = {}
    for rel in sorted(files):
        step = checkpoint_step(rel)
        if step is None:
            continue
        if step in committed:
            checkpoints[step] = root / rel
        elif end is not None:
            raise MalformedInput(f"{rel} is not committed by any signed record")
        else:
            notes.append(f"ignored {rel}, which no signed record commits")
    missing = sorted(committed - set(checkpoints))
    if manifest.online is not None:
        # An online run is audited from the states kept for its selected steps: it may leave out
        # its checkpoints, all but the final one (the released model), which a finished run carries.
        final = len(steps) if end is not None else None
        if final in missing:
            raise VerificationError(f"the final checkpoint (after step {final}) is committed but missing",
                                    check="checkpoint")
        if missing:
            notes.append(f"{len(missing)} committed checkpoint(s) left out (an online run is audited from the "
                         "states kept for its selected steps)")
    elif missing:
        raise VerificationError(f"the checkpoint after step {missing[0]} is committed but missing", check="checkpoint")
    if not steps:
        # Nothing is claimed yet: a run stopped before its first signed head is unusable, not dishonest.
        raise MalformedInput("the signed log holds no training step: the run stopped before its first checkpoint "
                             "was signed (continue it with witness train --resume)")
    if steps[-1].state_hash is None:
        # Replay must end on a committed state: a log signed up to an uncommitted step would leave
        # its last states bound by nothing but their fingerprints.
        raise VerificationError("the signed log ends at a step whose training state it does not commit",
                                step=steps[-1].step, check="log")
    leaves = root / LEAVES if LEAVES in files else None
    if leaves is not None and manifest.data_commitment < 2:
        raise MalformedInput(f"{LEAVES} belongs to a run that commits its dataset's leaves (data_commitment 2)")
    online: dict[str, dict[int, Path]] = {"states": {}, "samples": {}, "chunks": {}}
    shards: dict[int, dict[int, Path]] = {}
    for rel in files:
        found = online_file(rel)
        if found is not None:
            online[found[0]][found[1]] = root / rel
        share = online_shard(rel)
        if share is not None:
            shards.setdefault(share[0], {})[share[1]] = root / rel
    _check_shards(shards, online["states"], manifest)
    if manifest.online is None and (STATEMENTS in files or any(online.values()) or shards):
        raise MalformedInput(f"the bundle holds {ONLINE}/ files, but its manifest takes no online challenges")
    if online["chunks"] and not manifest.chunked:
        raise MalformedInput(f"the bundle holds {ONLINE_CHUNKS}/ files, but its manifest commits no parameter chunks")
    if STATEMENTS in files:
        _check_statement_lines(root / STATEMENTS)
    return Bundle(root, manifest, steps, end, log, heads, checkpoints, notes, leaves,
                  root / STATEMENTS if STATEMENTS in files else None, online["states"], online["samples"],
                  online["chunks"], missing if manifest.online is not None else [],
                  root / PROBES if PROBES in files else None, online_shards=shards)


def _check_shards(shards: dict[int, dict[int, Path]], whole: dict[int, Path], manifest: Manifest) -> None:
    """Kept shares of states belong to a run over several ranks, one per rank, never beside a whole
    copy of the same state (two files for one state: which would replay?). A share left out is not
    refused here: the state is then not kept, which the audit reports where it needs the state."""
    for step, ranks in sorted(shards.items()):
        if manifest.world_size < 2:
            raise MalformedInput(f"{ONLINE_STATES}/ holds ranks' shares of the state after {step} update(s), but the "
                                 "run trained in one process")
        beyond = [r for r in ranks if r >= manifest.world_size]
        if beyond:
            raise MalformedInput(f"{ONLINE_STATES}/ holds a share of rank {beyond[0]} of the state after {step} "
                                 f"update(s); the run had {manifest.world_size} ranks")
        if step in whole:
            raise MalformedInput(f"{ONLINE_STATES}/ holds the state after {step} update(s) both whole and as ranks' "
                                 "shares")


def _check_statement_lines(path: Path) -> None:
    """Every whole line of the beacon's statements is a statement (every mode reads the bundle so:
    a garbage file is refused by offline verification too, not only by the online audit). A last
    line torn by a crash is left to the online audit, which refuses it; offline needs none."""
    from ..commit.window import parse_statement

    lines, _ = _lines(_read_bounded(path, MAX_STATEMENTS_BYTES, STATEMENTS), STATEMENTS)
    for i, line in enumerate(lines):
        try:
            parse_statement(parse_canonical_json(line))
        except (ValueError, VerificationError) as e:
            raise MalformedInput(f"{STATEMENTS}: line {i + 1} is not a beacon statement: {e}") from None


def statements_bound(manifest) -> int:  # noqa: ANN001 - a Manifest
    """The most bytes ``online/statements.jsonl`` may hold for this manifest: ``MAX_STATEMENTS_BYTES``, or,
    for a long witnessed run, a window line a head (a head every ``every`` steps and at every checkpoint,
    each at most a full note: ML-DSA-44 cosignatures are 3.3 KB a witness) and the final window's counts."""
    from ..commit.window import MAX_ATTEMPT_NOTES, MAX_NOTE_BYTES

    online = getattr(manifest, "online", None)
    every = online.get("every") if isinstance(online, dict) else None
    if type(every) is not int or every < 1:
        return MAX_STATEMENTS_BYTES
    steps = manifest.steps_planned
    heads = -(-steps // every) + -(-steps // manifest.checkpoint_every) + 2
    # (never over 1 GiB, whatever a manifest claims: a verifier reads the file whole)
    return min(1 << 30, max(MAX_STATEMENTS_BYTES, heads * (MAX_NOTE_BYTES + 2048) + MAX_ATTEMPT_NOTES * MAX_NOTE_BYTES))
