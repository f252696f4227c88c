"""Names, version and size limits of the bundle format."""

from __future__ import annotations

import re

from ..commit.hashing import canonical_json

FORMAT = "witness-bundle"
VERSION = 2
MARKER = "bundle.json"
LOG = "log.jsonl"
HEADS = "heads.jsonl"
CHECKPOINTS = "checkpoints"
# the dataset's per-sample commitments (data/leaves.py), checked against the manifest's data root
LEAVES = "dataset.leaves"
# the probe inputs, as the canonical JSON list of their hex whose SHA-256 is the manifest's
# probe_hash: a verifier without the training data reads them here (the task checks them)
PROBES = "probes.json"
MAX_PROBES_BYTES = 64 * 1024 * 1024

MAX_LOG_BYTES = 512 * 1024 * 1024
MAX_RECORD_BYTES = 4 * 1024 * 1024
MAX_HEADS_BYTES = 64 * 1024 * 1024
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024 * 1024
MAX_SAFETENSORS_HEADER = 16 * 1024 * 1024
MAX_FILES = 1_000_000

CHECKPOINT_RE = re.compile(r"^checkpoints/([0-9]{8,12})\.safetensors$")


def marker_bytes(version: int = VERSION) -> bytes:
    """The exact content of ``bundle.json``."""
    return canonical_json({"format": FORMAT, "version": version}) + b"\n"


def checkpoint_name(step: int) -> str:
    """Relative path of the checkpoint holding the state after ``step`` updates."""
    return f"{CHECKPOINTS}/{step:08d}.safetensors"


def checkpoint_step(rel: str) -> int | None:
    """The step a checkpoint's relative path names, or None if the format names no such file.

    Only the one spelling ``checkpoint_name`` writes counts: another zero-padding of the same step
    would be a second file for one state, an alias that could shadow the committed one."""
    m = CHECKPOINT_RE.match(rel)
    if m is None or rel != checkpoint_name(int(m.group(1))):
        return None
    return int(m.group(1))


def partial_write(rel: str) -> bool:
    """Whether ``rel`` is what a write cut short by a crash leaves in ``checkpoints/`` or
    ``online/states|samples|chunks/``: our ``NAME.tmp``, or the ``.tmpXXXXXX`` file safetensors writes
    a file through (it renames it into place only when the file is whole)."""
    folder, _, name = rel.rpartition("/")
    if folder not in (CHECKPOINTS, ONLINE_STATES, ONLINE_SAMPLES, ONLINE_CHUNKS):
        return False
    if name.startswith(".tmp") and len(name) <= 16 and name[4:].isalnum():
        return True
    whole = f"{folder}/{name.removesuffix('.tmp')}"
    return name.endswith(".tmp") and (checkpoint_step(whole) is not None or online_file(whole) is not None
                                      or online_shard(whole) is not None)


def due(step: int, every: int, steps: int) -> bool:
    """Whether the state after ``step`` is committed on an ``every``-step cadence: every
    ``every`` updates, and after the last step of the recipe."""
    done = step + 1
    return done % every == 0 or done == steps


# Online challenges: the beacon's statements as received, and for every step they select the
# committed state before it and its batch's samples (what the verifier replays it from).
ONLINE = "online"
STATEMENTS = f"{ONLINE}/statements.jsonl"
# a witnessed run's journal of checkpoints the witnesses cosigned whose rounds had not come yet (what a
# resume settles: a witness keeps only the latest checkpoint, so a lost cosignature cannot be asked
# for again); removed when the run finishes, never read by a verifier
COSIGNED = f"{ONLINE}/cosigned.jsonl"
MAX_JOURNAL_BYTES = 64 << 20  # cosigned checkpoints waiting for their rounds: a few KiB each
ONLINE_STATES = f"{ONLINE}/states"
ONLINE_SAMPLES = f"{ONLINE}/samples"
# a run that commits its parameters' chunks: for every window, the chunks its beta opens of every
# state its steps go from and to, with their Merkle paths (named by the head size the window closes at)
ONLINE_CHUNKS = f"{ONLINE}/chunks"
MAX_STATEMENTS_BYTES = 64 * 1024 * 1024
ONLINE_RE = re.compile(r"^online/(states|samples|chunks)/([0-9]{8,12})\.(safetensors|json)$")
ONLINE_SHARD_RE = re.compile(r"^online/states/([0-9]{8,12})\.rank([0-9]{4})\.safetensors$")


def online_state_name(step: int) -> str:
    """Relative path of the state before ``step`` (after ``step`` updates), kept because a beacon selected it."""
    return f"{ONLINE_STATES}/{step:08d}.safetensors"


def online_shard_name(step: int, rank: int) -> str:
    """Relative path of rank ``rank``'s share of the rows of the state after ``step`` updates, in a
    run over several ranks (each rank keeps and writes its own share; docs/format.md)."""
    return f"{ONLINE_STATES}/{step:08d}.rank{rank:04d}.safetensors"


def online_shard(rel: str) -> tuple[int, int] | None:
    """(step, rank) for a name ``online_shard_name`` writes (that one spelling only), else None."""
    m = ONLINE_SHARD_RE.match(rel)
    if m is None:
        return None
    step, rank = int(m.group(1)), int(m.group(2))
    return (step, rank) if rel == online_shard_name(step, rank) else None


def online_samples_name(step: int) -> str:
    """Relative path of the samples of the batch of ``step``, a selected step."""
    return f"{ONLINE_SAMPLES}/{step:08d}.json"


def online_chunks_name(size: int) -> str:
    """Relative path of the chunk openings of the window that closes at the head of ``size`` records."""
    return f"{ONLINE_CHUNKS}/{size:08d}.safetensors"


def online_file(rel: str) -> tuple[str, int] | None:
    """("states", "samples" or "chunks", step or size) for a name ``online_state_name``,
    ``online_samples_name`` or ``online_chunks_name`` writes (that one spelling only)."""
    m = ONLINE_RE.match(rel)
    if m is None:
        return None
    kind, n = m.group(1), int(m.group(2))
    name = {"states": online_state_name, "samples": online_samples_name, "chunks": online_chunks_name}[kind]
    return (kind, n) if rel == name(n) else None
