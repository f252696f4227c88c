"""The whole training state as named tensors, its hash, and how far two states are apart.

A training state is every model parameter and buffer (``model.<state_dict key>``) and the whole
optimizer state with its step counters (``optim.<parameter>.<key>``). Its hash is the RFC 6962
Merkle root over one leaf per tensor, sorted by name; a leaf is the canonical JSON of the
tensor's name, dtype, shape and the digest of its raw bytes. The digest is BLAKE3 (fast, and
multi-threaded on large tensors) where the ``blake3`` package is installed, else SHA-256; the
manifest names the one a run used, and the verifier uses that one.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from ..commit.hashing import canonical_json, leaf_hash
from ..commit.merkle import merkle_root
from ..errors import MalformedInput

try:
    import blake3 as _blake3
except ImportError:  # the fallback: SHA-256 is always there
    _blake3 = None

DIGESTS = ("blake3", "sha256")
# Whole tensors are hashed several at once on a pool of threads (both hashes release the GIL);
# a tensor this large also has its chunks spread over BLAKE3's own threads.
_PARALLEL_BYTES = 16 << 20
# Below this much in all, a state is hashed on the calling thread: handing work to threads costs more.
_POOL_MIN_BYTES = 1 << 20
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
# a forked child has none of its parent's threads: it starts its own pools
os.register_at_fork(after_in_child=_pools.clear)


def default_digest() -> str:
    """The digest a new run uses: BLAKE3 where installed, else SHA-256."""
    return "blake3" if _blake3 is not None else "sha256"


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer, without copying a contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    if t.requires_grad:
        t = t.detach()
    try:
        return t.numpy().reshape(-1).view(np.uint8)  # the tensor's own bytes (numpy views are cheap)
    except TypeError:  # dtypes numpy lacks (bfloat16): the same bytes through torch
        return t.reshape(-1).view(torch.uint8).numpy()


def tensor_digest(t: torch.Tensor, digest: str) -> str:
    """Hex digest of a tensor's raw bytes."""
    raw = _raw(t)
    if digest == "sha256":
        return hashlib.sha256(raw).hexdigest()
    if digest == "blake3":
        if _blake3 is None:
            raise MalformedInput("this run's states are hashed with BLAKE3: install the blake3 package")
        threads = _blake3.blake3.AUTO if raw.nbytes >= _PARALLEL_BYTES else 1
        return _blake3.blake3(raw, max_threads=threads).hexdigest()
    raise MalformedInput(f"unknown state digest {digest!r}; known: {', '.join(DIGESTS)}")


def tensor_leaf(name: str, t: torch.Tensor, digest: str) -> bytes:
    """Leaf of the state tree: canonical JSON of name, dtype, shape and the digest of the bytes."""
    return leaf_hash(canonical_json({
        "name": name,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        digest: tensor_digest(t, digest),
    }))


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="witness-hash")
        return _pools[workers]


def state_hash(tensors: dict[str, torch.Tensor], digest: str) -> bytes:
    """Merkle root over the named tensors, sorted by name.

    The tensors are hashed on as many threads as torch may use (``torch.get_num_threads()``),
    so the trainer's own thread bound also bounds the hash; the root does not depend on it.
    """
    names = sorted(tensors)
    size = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    workers = torch.get_num_threads()
    if workers < 2 or sum(size.values()) < _POOL_MIN_BYTES:
        return merkle_root([tensor_leaf(n, tensors[n], digest) for n in names])
    # One share of about equal bytes per thread (the largest tensors dealt first): a task per
    # tensor would cost more in hand-offs than the hashing of a small tensor takes.
    shares: list[list[str]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for n in sorted(names, key=size.__getitem__, reverse=True):
        i = loads.index(min(loads))
        shares[i].append(n)
        loads[i] += size[n]

    def hash_share(share: list[str]) -> list[tuple[str, bytes]]:
        return [(n, tensor_leaf(n, tensors[n], digest)) for n in share]

    pending = [_pool(workers - 1).submit(hash_share, share) for share in shares[1:]]
    leaves = dict(hash_share(shares[0]))  # the calling thread takes a share too
    for f in pending:
        leaves.update(f.result())
    return merkle_root([leaves[n] for n in names])


def model_hash(tensors: dict[str, torch.Tensor], digest: str) -> bytes:
    """Hash of the model part of a state (what a released weights file holds)."""
    return state_hash({k: v for k, v in tensors.items() if k.startswith("model.")}, digest)


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
        p = params[pname]
        # moments live with their parameter; scalar counters (AdamW's step) stay on the host
        optimizer.state[p][key] = v.to(p.device, copy=True) if v.shape == p.shape else v.clone()
        seen.add(k)
    if len(seen) + len(model_sd) != len(tensors):
        raise MalformedInput("checkpoint holds tensors that are neither model nor optimizer state")


def _relative_l2(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """||a - b|| / ||b|| over all coordinates of all pairs, accumulated in float64."""
    num = den = 0.0
    for a, b in pairs:
        a64, b64 = a.detach().cpu().to(torch.float64), b.detach().cpu().to(torch.float64)
        num += float((a64 - b64).pow(2).sum())
        den += float(b64.pow(2).sum())
    if den > 0:
        return math.sqrt(num / den)
    return 0.0 if num == 0 else math.inf


def state_distances(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    parameters: set[str]) -> dict[str, float]:
    """How far a replayed state is from a committed one, for tolerance mode.

    ``parameters`` names the ``model.*`` tensors that are parameters. Returns the relative L2
    distance over *all* coordinates of the parameters, of the floating buffers, and of each
    optimizer-state key (``optimizer.exp_avg``, ``optimizer.exp_avg_sq``, …) across all
    parameters. Names, shapes, dtypes, step counters and integer buffers (``num_batches_tracked``)
    must be equal: a ``ValueError`` says which is not.
    """
    if set(got) != set(want):
        diff = sorted(set(got) ^ set(want))
        raise ValueError(f"the states hold different tensors ({', '.join(diff[:3])})")
    groups: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"parameters": []}
    for k in sorted(want):
        a, b = got[k], want[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{k} has another shape or dtype")
        if not b.is_floating_point() or k.endswith(".step"):
            if not torch.equal(a, b):
                raise ValueError(f"{k} differs" + (f": {a.item()} against {b.item()}" if a.numel() == 1 else ""))
            continue
        if k.startswith("model."):
            group = "parameters" if k in parameters else "buffers"
        else:
            group = "optimizer." + k.rpartition(".")[2]
        groups.setdefault(group, []).append((a, b))
    return {g: _relative_l2(pairs) for g, pairs in groups.items()}
