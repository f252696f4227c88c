"""Checkpoints as safetensors files, and the state hash over named tensors."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..commit.hashing import canonical_json, leaf_hash
from ..commit.merkle import merkle_root
from ..errors import MalformedInput
from .layout import MAX_CHECKPOINT_BYTES, MAX_SAFETENSORS_HEADER

STATE_FORMAT = "witness-state/v1"


def tensor_leaf(name: str, t: torch.Tensor) -> bytes:
    """Leaf of the state tree: canonical JSON of name, dtype, shape and SHA-256 of the bytes."""
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return leaf_hash(
        canonical_json(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        )
    )


def state_hash(tensors: dict[str, torch.Tensor]) -> bytes:
    """Merkle root over the named tensors, sorted by name (shards hash the same way)."""
    return merkle_root([tensor_leaf(n, tensors[n]) for n in sorted(tensors)])


def model_hash(tensors: dict[str, torch.Tensor]) -> bytes:
    """Hash of the model part of a state (what a released weights file holds)."""
    return state_hash({k: v for k, v in tensors.items() if k.startswith("model.")})


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """A training state as flat named tensors: ``model.*`` and ``optim.<param>.<key>``."""
    out = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            for key, value in st.items():
                if not torch.is_tensor(value):
                    value = torch.tensor(value)
                out[f"optim.{names[id(p)]}.{key}"] = value.detach()
    return out


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, torch.Tensor]) -> None:
    """Put a flat state back into a model and its optimizer, refusing missing or extra tensors."""
    model_sd = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(model.state_dict()) - set(model_sd)
    extra = set(model_sd) - set(model.state_dict())
    if missing or extra:
        raise MalformedInput(f"checkpoint does not fit the model (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for k, v in model.state_dict().items():
        if model_sd[k].shape != v.shape or model_sd[k].dtype != v.dtype:
            raise MalformedInput(f"checkpoint tensor {k} has the wrong shape or dtype")
    model.load_state_dict(model_sd)
    if optimizer is None:
        return
    params = dict(model.named_parameters())
    optimizer.state.clear()
    seen = set()
    for k, v in tensors.items():
        if not k.startswith("optim."):
            continue
        pname, _, key = k[6:].rpartition(".")
        if pname not in params:
            raise MalformedInput(f"checkpoint has optimizer state for unknown parameter {pname}")
        optimizer.state[params[pname]][key] = v.clone()
        seen.add(k)
    if len(seen) + len(model_sd) != len(tensors):
        raise MalformedInput("checkpoint holds tensors that are neither model nor optimizer state")


def save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], step: int) -> tuple[bytes, bytes]:
    """Write atomically (temp file, fsync, rename); returns (state hash, file SHA-256)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": STATE_FORMAT, "step": str(step)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return state_hash(tensors), file_sha256(path)


def file_sha256(path: Path) -> bytes:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Strictly load a safetensors checkpoint: bounded size and header, never a pickle."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise MalformedInput(f"{path.name} is {size} bytes, over the {MAX_CHECKPOINT_BYTES}-byte limit")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MalformedInput(f"{path.name} is not a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or n + 8 > size:
            raise MalformedInput(f"{path.name} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise MalformedInput(f"{path.name} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict) or header.get("__metadata__", {}).get("format") != STATE_FORMAT:
        raise MalformedInput(f"{path.name} is not a witness state file")
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError) as e:
        raise MalformedInput(f"{path.name} is not a valid safetensors file: {e}") from None
