"""A window's chunk openings: for every state its steps go from and to, the parameter chunks its
beta opens and their Merkle paths, as one safetensors file (``online/chunks/<head size>.safetensors``).

The file holds two uint8 tensors, ``chunks`` [states, k, chunk bytes] and ``paths`` [states, nodes,
32] (each state's paths one after the other, in the order of the chunks), and metadata naming the
window (the head size it closes at), its first state and its chunks. Version 2 (a run whose chunks
open into its state hash, ``witness.bundle.opened``) holds ``paths`` [nodes, 32]: every state's paths
one after the other, as a state's may be longer than another's. The reader takes nothing on the
file's word: it is told the shape the window must have and refuses any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MalformedInput, VerificationError
from .checkpoint import safetensors_bytes, safetensors_header

OPENINGS_FORMAT = "witness-chunk-openings/v1"
TREE_OPENINGS_FORMAT = "witness-chunk-openings/v2"
MAX_OPENINGS_BYTES = 1 << 30


@dataclass(frozen=True)
class WindowOpenings:
    """The openings of one window: ``chunks`` [states, k, chunk bytes] and ``paths`` [states, nodes, 32]
    (version 2: [nodes, 32]) for the states ``first`` .. ``first + states - 1`` at the chunk indices
    ``indices``."""

    size: int
    first: int
    indices: tuple[int, ...]
    chunks: np.ndarray
    paths: np.ndarray
    version: int = 1

    def metadata(self) -> dict[str, str]:
        """The file's metadata (strings, as safetensors keeps them)."""
        return {"format": TREE_OPENINGS_FORMAT if self.version == 2 else OPENINGS_FORMAT, "size": str(self.size),
                "first": str(self.first),
                "chunks": ",".join(map(str, self.indices))}


def write_openings(path: Path, openings: WindowOpenings) -> int:
    """Write the file atomically (a temp file renamed into place); its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(safetensors_bytes({"chunks": np.ascontiguousarray(openings.chunks),
                                       "paths": np.ascontiguousarray(openings.paths)}, openings.metadata()))
    tmp.replace(path)
    return path.stat().st_size


def read_openings(path: Path, size: int, first: int, states: int, indices: tuple[int, ...], chunk_bytes: int,
                  nodes: int, version: int = 1) -> WindowOpenings:
    """The openings of the window closing at ``size``, which must be exactly of this shape: ``states``
    states from ``first``, the chunks ``indices`` of ``chunk_bytes`` each, ``nodes`` path nodes a state
    (version 2: in all)."""
    want = {"chunks": [states, len(indices), chunk_bytes],
            "paths": [nodes, 32] if version == 2 else [states, nodes, 32]}
    expected = WindowOpenings(size, first, indices, np.empty(0), np.empty(0), version).metadata()
    data_bytes = states * len(indices) * chunk_bytes + (nodes if version == 2 else states * nodes) * 32
    limit = min(MAX_OPENINGS_BYTES, data_bytes + (1 << 16))
    raw = _read(path, limit)
    header = safetensors_header(path, limit, raw)
    # a readable file of another window (or another shape) is the trainer's answer, and the wrong one:
    # a rejection, as missing openings are; only a file that is not safetensors is unusable input
    if set(header) != {"__metadata__", *want} or header["__metadata__"] != expected:
        raise VerificationError(f"{path.name} is not the chunk openings of the window closing at size {size} (its "
                                f"states from {first}, chunks {','.join(map(str, indices))})", step=first,
                                check="moves")
    for name, shape in want.items():
        t = header[name]
        if not isinstance(t, dict) or t.get("dtype") != "U8" or not _ints(t.get("shape"), shape):
            raise VerificationError(f"{path.name}: {name} must be uint8 of shape {shape}", step=first, check="moves")
    # the data must be the two tensors, back to back, and nothing else (what safetensors writes)
    split = states * len(indices) * chunk_bytes
    body = 8 + int.from_bytes(raw[:8], "little")
    if not _ints(header["chunks"].get("data_offsets"), [0, split]) \
            or not _ints(header["paths"].get("data_offsets"), [split, data_bytes]) or len(raw) != body + data_bytes:
        raise MalformedInput(f"{path.name} is not a valid safetensors file: its tensors are not where its header "
                             "says, or bytes follow them")
    array = np.frombuffer(raw, dtype=np.uint8, offset=body)
    return WindowOpenings(size, first, indices, array[:split].reshape(want["chunks"]),
                          array[split:].reshape(want["paths"]), version)


def _ints(value: object, want: list[int]) -> bool:
    """Whether a header's list is exactly these integers (JSON's 64.0 or true are not 64 or 1)."""
    return isinstance(value, list) and len(value) == len(want) and all(
        type(x) is int and x == w for x, w in zip(value, want, strict=True))


def _read(path: Path, limit: int) -> bytes:
    """The file's bytes, refused past ``limit``."""
    size = path.stat().st_size
    if size > limit:
        raise MalformedInput(f"{path.name} is {size} bytes, over the {limit}-byte limit")
    return path.read_bytes()
