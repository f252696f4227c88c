"""Checkpoints: training states as safetensors files, written atomically and read strictly."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as save_numpy
from safetensors.torch import load_file, save_file

from ..commit.hashing import file_sha256, load_json
from ..errors import MalformedInput
from .layout import MAX_CHECKPOINT_BYTES, MAX_SAFETENSORS_HEADER
from .state import state_hash

STATE_FORMAT = "witness-state/v1"


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, with the same bytes for the same tensors and metadata.

    safetensors keeps the metadata in a hash map whose order changes from one map to the next,
    so the same state could be written as different files (and a released model named by two
    SHA-256s). The metadata is rewritten in place, sorted by key: the same strings, so the same
    length, and nothing else in the header moves.
    """
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        # safetensors reports I/O failures (a full disk) as its own error: make it the OSError it is
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None
    if len(metadata) < 2:
        return
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        ordered = _ordered(f.read(n).decode("utf-8"))
        f.seek(8)
        f.write(ordered)


def _ordered(header: str) -> bytes:
    """A safetensors header with its metadata sorted by key: the same strings, so the same length."""
    meta = json.loads(header)["__metadata__"]
    compact = lambda m: json.dumps({"__metadata__": m}, separators=(",", ":"), ensure_ascii=False)[:-1]  # noqa: E731
    written, ordered = compact(meta), compact(dict(sorted(meta.items())))
    if not header.startswith(written) or len(written.encode()) != len(ordered.encode()):
        raise RuntimeError("safetensors wrote a header of an unexpected layout; the metadata cannot be ordered")
    return ordered.encode("utf-8")


def safetensors_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A small safetensors file of numpy arrays in memory, as ``save_safetensors`` writes them (the same
    bytes, its metadata ordered): one write, with no tensors to build."""
    raw = bytearray(save_numpy(arrays, metadata=metadata))
    if len(metadata) >= 2:
        (n,) = struct.unpack("<Q", raw[:8])
        ordered = _ordered(raw[8:8 + n].decode("utf-8"))
        raw[8:8 + len(ordered)] = ordered
    return bytes(raw)


def save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], step: int, digest: str) -> tuple[bytes, bytes]:
    """Write atomically (temp file, fsync, rename); returns (state hash, file SHA-256)."""
    write_state(path, tensors, step)
    return state_hash(tensors, digest), file_sha256(path)


def write_state(path: Path, tensors: dict[str, torch.Tensor], step: int, sync: bool = True) -> None:
    """Write a state atomically (temp file, fsync, rename), in the checkpoint format (``sync=False``:
    no fsync, for a scratch copy that nothing needs after a crash)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    out, storages = {}, set()
    for k, v in tensors.items():
        t = v.contiguous()
        ptr = t.untyped_storage().data_ptr()
        # Tied weights (an LM head sharing the embedding) are one storage under two names:
        # safetensors stores each name on its own, so the second is written as a copy.
        out[k] = t.clone() if ptr in storages and t.numel() else t
        storages.add(ptr)
    save_safetensors(out, tmp, {"format": STATE_FORMAT, "step": str(step)})
    if sync:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def safetensors_header(path: Path, limit: int = MAX_CHECKPOINT_BYTES, data: bytes | None = None) -> dict:
    """A safetensors file's JSON header, read strictly (the file at most ``limit`` bytes, the header
    bounded), before any tensor is loaded; from ``data``, the file's bytes, where the caller read them."""
    path = Path(path)
    size = path.stat().st_size if data is None else len(data)
    if size > limit:
        raise MalformedInput(f"{path.name} is {size} bytes, over the {limit}-byte limit")
    if data is None:
        with open(path, "rb") as f:
            data = f.read(8)
            if len(data) == 8:
                data += f.read(min(struct.unpack("<Q", data)[0], MAX_SAFETENSORS_HEADER + 1))
    if len(data) < 8:
        raise MalformedInput(f"{path.name} is not a safetensors file (truncated)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_SAFETENSORS_HEADER or n + 8 > size:
        raise MalformedInput(f"{path.name} is not a safetensors file (header length {n})")
    try:
        header = load_json(data[8:8 + n])
    except ValueError:
        raise MalformedInput(f"{path.name} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise MalformedInput(f"{path.name} is not a safetensors file (bad header)")
    for name, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) and name != "__metadata__" else []
        # a dimension larger than any file holds can only come with another of 0 (no bytes): numpy and
        # torch then overflow on the element count, so such a shape is refused here
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= MAX_CHECKPOINT_BYTES for d in shape):
            raise MalformedInput(f"{path.name}: tensor {str(name)[:80]!r} has the shape {str(shape)[:80]}, which no "
                                 "state tensor has")
    return header


def read_checkpoint(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Strictly load a safetensors checkpoint: bounded size and header, never a pickle; only the tensors
    in ``names`` (those it holds) where given, reading no others' bytes."""
    path = Path(path)
    header = safetensors_header(path)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise MalformedInput(f"{path.name} is not a witness state file")
    try:
        if names is None:
            return load_file(str(path))
        with safe_open(str(path), "pt") as f:
            return {n: f.get_tensor(n) for n in names if n in header}
    except (SafetensorError, ValueError, OSError, TypeError, OverflowError, RuntimeError) as e:
        raise MalformedInput(f"{path.name} is not a valid safetensors file: {e}") from None
