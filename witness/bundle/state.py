"""The whole training state as named tensors, its hash, and how far two states are apart.

A training state is every model parameter and buffer (``model.<state_dict key>``) and the whole
optimizer state with its step counters (``optim.<parameter>.<key>``). Its hash is the RFC 6962
Merkle root over one leaf per tensor, sorted by name; a leaf is the canonical JSON of the
tensor's name, dtype, shape and the digest of its raw bytes. The digest is BLAKE3 (fast, and
multi-threaded on large tensors) where the ``blake3`` package is installed, else SHA-256; the
manifest names the one a run used, and the verifier uses that one.

An FSDP2 run over W ranks names its digest ``"<hash>/W"`` (``"blake3/8"``): a tensor's digest is
then the hash of the concatenated digests of its W row shards, FSDP2's split of dim 0 into
chunks of ceil(rows / W) rows (the last ones short or empty), so that each rank hashes the rows
it holds and no rank gathers the state. A 0-dimensional tensor is hashed whole. One process
holding the whole tensors computes the same root by splitting them the same way.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from ..commit.hashing import canonical_json, leaf_hash
from ..commit.merkle import merkle_root
from ..errors import MalformedInput, VerificationError
from ..fingerprint.chunks import alias_groups, shard_rows

try:
    import blake3 as _blake3
except ImportError:  # the fallback: SHA-256 is always there
    _blake3 = None

DIGESTS = ("blake3", "sha256")
MAX_SHARDS = 1024  # the most row shards a state digest may name (each one is a hash call per tensor)
# Whole tensors are hashed several at once on a pool of threads (both hashes release the GIL);
# a tensor this large also has its chunks spread over BLAKE3's own threads.
_PARALLEL_BYTES = 16 << 20
# Below this much in all, a state is hashed on the calling thread: handing work to threads costs more.
_POOL_MIN_BYTES = 1 << 20
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
# a forked child has none of its parent's threads: it starts its own pools
os.register_at_fork(after_in_child=_pools.clear)


def default_digest(shards: int = 1) -> str:
    """The digest a new run uses: BLAKE3 where installed, else SHA-256; over ``shards`` row shards
    (one per rank) for an FSDP2 run over several ranks."""
    return ("blake3" if _blake3 is not None else "sha256") + (f"/{shards}" if shards > 1 else "")


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer, without copying a contiguous CPU tensor."""
    if t.numel() == 0:  # no bytes, whatever its shape says (numpy refuses a huge shape of 0 elements)
        return np.empty(0, dtype=np.uint8)
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    if t.requires_grad:
        t = t.detach()
    try:
        return t.numpy().reshape(-1).view(np.uint8)  # the tensor's own bytes (numpy views are cheap)
    except TypeError:  # dtypes numpy lacks (bfloat16): the same bytes through torch
        return t.reshape(-1).view(torch.uint8).numpy()


def parse_digest(spec: str) -> tuple[str, int]:
    """A state digest's hash and row-shard count: ``"blake3"`` is (blake3, 1), ``"blake3/8"`` (blake3, 8)."""
    name, slash, shards = spec.partition("/") if isinstance(spec, str) else ("", "", "")
    if name not in DIGESTS:
        raise MalformedInput(f"unknown state digest {spec!r}; known: {', '.join(DIGESTS)}, optionally /<shards>")
    if not slash:
        return name, 1
    if not (shards.isdigit() and shards[0] != "0" and 2 <= int(shards) <= MAX_SHARDS):
        raise MalformedInput(f"state digest {spec!r}: the shard count must be 2 to {MAX_SHARDS}")
    return name, int(shards)


def bytes_digest(raw, name: str) -> str:
    """Hex digest of a buffer with the hash ``name`` (no shards)."""
    if name == "sha256":
        return hashlib.sha256(raw).hexdigest()
    if name == "blake3":
        if _blake3 is None:
            raise MalformedInput("this run's states are hashed with BLAKE3: install the blake3 package")
        size = raw.nbytes if hasattr(raw, "nbytes") else len(raw)
        threads = _blake3.blake3.AUTO if size >= _PARALLEL_BYTES else 1
        return _blake3.blake3(raw, max_threads=threads).hexdigest()
    raise MalformedInput(f"unknown state digest {name!r}; known: {', '.join(DIGESTS)}")


def combine_shards(shard_digests: list[str], name: str) -> str:
    """A sharded tensor's digest: the hash of its shards' digests, in rank order."""
    return bytes_digest(b"".join(bytes.fromhex(d) for d in shard_digests), name)


def tensor_digest(t: torch.Tensor, digest: str) -> str:
    """Hex digest of a tensor's raw bytes (of its row shards' digests, for a sharded digest)."""
    name, shards = parse_digest(digest)
    raw = _raw(t)
    if shards == 1 or t.dim() == 0:
        return bytes_digest(raw, name)
    row = raw.nbytes // t.shape[0] if t.shape[0] else 0  # rows are contiguous runs of bytes
    return combine_shards([bytes_digest(raw[a * row:b * row], name) for a, b in shard_rows(t.shape[0], shards)], name)


def leaf(name: str, dtype: torch.dtype, shape, digest: str, hexdigest: str) -> bytes:
    """Leaf of the state tree from a tensor's description and digest."""
    if len(hexdigest) == 64 and hexdigest.isalnum() and hexdigest.isascii():
        around = _leaf_template(name, dtype, tuple(shape), digest)
        if around is not None:  # the same bytes as below, without encoding the same JSON every step
            return leaf_hash(around[0] + hexdigest.encode("ascii") + around[1])
    return leaf_hash(_leaf_json(name, dtype, shape, digest, hexdigest))


def _leaf_json(name: str, dtype: torch.dtype, shape, digest: str, hexdigest: str) -> bytes:  # noqa: ANN001
    return canonical_json({"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                           digest: hexdigest})


_MARK = "0" * 63 + "x"  # a digest no hash gives (hex has no x): where a template's digest goes


@functools.lru_cache(maxsize=1 << 16)
def _leaf_template(name: str, dtype: torch.dtype, shape: tuple, digest: str) -> tuple[bytes, bytes] | None:
    """A leaf's canonical JSON cut where its 64-character digest goes (None: the mark is not found once,
    as in a name that holds it: the JSON is then encoded whole)."""
    parts = _leaf_json(name, dtype, shape, digest, _MARK).split(_MARK.encode("ascii"))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def tensor_leaf(name: str, t: torch.Tensor, digest: str) -> bytes:
    """Leaf of the state tree: canonical JSON of name, dtype, shape and the digest of the bytes."""
    return leaf(name, t.dtype, t.shape, digest, tensor_digest(t, digest))


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
    leaves = on_threads(tensors, lambda n, t: tensor_leaf(n, t, digest))
    return merkle_root([leaves[n] for n in sorted(tensors)])


def on_threads(tensors: dict[str, torch.Tensor], fn: Callable[[str, torch.Tensor], Any]) -> dict[str, Any]:
    """``{name: fn(name, tensor)}``, computed on up to ``torch.get_num_threads()`` threads."""
    names = sorted(tensors)
    size = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    workers = torch.get_num_threads()
    if workers < 2 or sum(size.values()) < _POOL_MIN_BYTES:
        return {n: fn(n, tensors[n]) for n in names}
    # One share of about equal bytes per thread (the largest tensors dealt first): a task per
    # tensor would cost more in hand-offs than the hashing of a small tensor takes.
    shares: list[list[str]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for n in sorted(names, key=size.__getitem__, reverse=True):
        i = loads.index(min(loads))
        shares[i].append(n)
        loads[i] += size[n]

    def run_share(share: list[str]) -> list[tuple[str, Any]]:
        return [(n, fn(n, tensors[n])) for n in share]

    pending = [_pool(workers - 1).submit(run_share, share) for share in shares[1:]]
    out = dict(run_share(shares[0]))  # the calling thread takes a share too
    for f in pending:
        out.update(f.result())
    return out


def shard_digests(pieces: dict[str, torch.Tensor], digest: str) -> dict[str, str]:
    """One rank's part of a sharded state digest: the hex digest of each of its row pieces."""
    name = parse_digest(digest)[0]
    return on_threads(pieces, lambda _, t: bytes_digest(_raw(t), name))


def root_from_shards(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], ranks: list[dict[str, str]],
                     digest: str) -> bytes:
    """The state's root from every rank's ``shard_digests`` (rank order) and each tensor's dtype and
    full shape: what ``state_hash`` gives on the whole tensors with the same sharded digest."""
    name, shards = parse_digest(digest)
    if len(ranks) != shards or any(set(r) != set(layout) for r in ranks):
        raise ValueError("every rank must hash a piece of every tensor of the state")
    leaves = []
    for n in sorted(layout):
        dtype, shape = layout[n]
        # a 0-dimensional tensor is hashed whole (every rank holds it): rank 0's digest is its
        d = ranks[0][n] if not shape else combine_shards([r[n] for r in ranks], name)
        leaves.append(leaf(n, dtype, shape, digest, d))
    return merkle_root(leaves)


def model_hash(tensors: dict[str, torch.Tensor], digest: str) -> bytes:
    """Hash of the model part of a state (what a released weights file holds). It is taken
    without shards: the same weights have the same identity however many ranks trained them."""
    return state_hash({k: v for k, v in tensors.items() if k.startswith("model.")}, parse_digest(digest)[0])


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """A training state as flat named tensors: ``model.*`` and ``optim.<param>.<key>``."""
    out = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    scaler = getattr(optimizer, "witness_scaler", None)
    if scaler is not None:  # an fp16 run's loss scale: it decides which steps update, so it is state
        sd = scaler.state_dict()
        out["scaler.scale"] = torch.tensor(sd["scale"], dtype=torch.float32)
        out["scaler.growth_tracker"] = torch.tensor(sd["_growth_tracker"], dtype=torch.int32)
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            for key, value in st.items():
                if not torch.is_tensor(value):
                    value = torch.tensor(value)
                out[f"optim.{names[id(p)]}.{key}"] = value.detach()
    return out


def check_aliases(groups: list[tuple[str, ...]], tensors: dict[str, torch.Tensor], where: str = "the state",
                  step: int | None = None) -> None:
    """Every name of each alias group (``alias_groups``: tied weights) holds the same bytes in a flat
    state; else a rejection naming both names."""
    for group in groups:
        held = [n for n in group if n in tensors]
        if not held:
            continue  # none of the group's names: not a model state (a missing tensor is refused where it is loaded)
        if len(held) < len(group):
            lost = next(n for n in group if n not in tensors)
            raise VerificationError(f"{where} holds {held[0]} but not {lost}, which is the same tensor in the task's "
                                    "model (tied weights)", step=step, check="state")
        first = tensors[group[0]]
        for name in group[1:]:
            t = tensors[name]
            # bytes, not values: NaN equals itself here, and -0.0 is not 0.0
            if t.dtype != first.dtype or t.shape != first.shape or not np.array_equal(_raw(first), _raw(t)):
                raise VerificationError(f"{where} holds different bytes under {group[0]} and {name}, which are one "
                                        "tensor in the task's model (tied weights)", step=step, check="state")


def _check_views(model: nn.Module, model_sd: dict[str, torch.Tensor], groups: list[tuple[str, ...]]) -> None:
    """After loading: names whose bytes share a storage other than as one tensor (views into one buffer)
    read back what the state holds, so overlapping views cannot carry two values either."""
    live = model.state_dict(keep_vars=True)
    storages: dict[tuple, list[str]] = {}
    for k, t in live.items():
        if t.numel() and t.device.type != "meta" and not hasattr(t, "to_local"):
            storages.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(f"model.{k}")
    tied = {n: set(g) for g in groups for n in g}
    for names in storages.values():
        if len(names) < 2 or set(names) == tied.get(names[0]):  # one tied tensor: compared before loading
            continue
        for n in names:
            if not np.array_equal(_raw(live[n[6:]]), _raw(model_sd[n[6:]])):
                others = ", ".join(m for m in names if m != n)
                raise VerificationError(f"the state's {n} is not what the task's model holds after loading it: its "
                                        f"bytes share storage with {others}, and the state holds other bytes there",
                                        check="state")


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, torch.Tensor]) -> None:
    """Put a flat state back into a model and its optimizer, refusing missing or extra tensors, and
    tied names (``check_aliases``) that hold different bytes."""
    model_sd = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(model.state_dict()) - set(model_sd)
    extra = set(model_sd) - set(model.state_dict())
    if missing or extra:
        raise MalformedInput(f"checkpoint does not fit the model (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for k, v in model.state_dict().items():
        if model_sd[k].shape != v.shape or model_sd[k].dtype != v.dtype:
            raise MalformedInput(f"checkpoint tensor {k} has the wrong shape or dtype")
    # torch would copy each tied name into the one tensor in turn, the last one winning: the state
    # hash and the chunk layout would then bind bytes that the loaded model does not run
    groups = alias_groups(model)
    check_aliases(groups, tensors)
    model.load_state_dict(model_sd)
    _check_views(model, model_sd, groups)
    if optimizer is None:
        return
    params = dict(model.named_parameters())
    optimizer.state.clear()
    seen = set()
    scaler = getattr(optimizer, "witness_scaler", None)
    if (scaler is not None) != ("scaler.scale" in tensors):
        raise MalformedInput("the state's loss scale does not fit the run (an fp16 run's state has one, others none)")
    if scaler is not None:
        scale, tracker = tensors.get("scaler.scale"), tensors.get("scaler.growth_tracker")
        if tracker is None or scale.shape != () or tracker.shape != () or scale.dtype != torch.float32 \
                or tracker.dtype != torch.int32:
            raise MalformedInput("the state's loss scale is not a float32 scale and an int32 growth tracker")
        sd = scaler.state_dict()
        sd.update(scale=float(scale), _growth_tracker=int(tracker))
        scaler.load_state_dict(sd)
        seen.update(("scaler.scale", "scaler.growth_tracker"))
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
        if not b.is_floating_point() or k.endswith(".step") or k.startswith("scaler."):  # counters, the loss scale
            if not torch.equal(a, b):
                raise ValueError(f"{k} differs" + (f": {a.item()} against {b.item()}" if a.numel() == 1 else ""))
            continue
        if k.startswith("model."):
            group = "parameters" if k in parameters else "buffers"
        else:
            group = "optimizer." + k.rpartition(".")[2]
        groups.setdefault(group, []).append((a, b))
    return {g: _relative_l2(pairs) for g, pairs in groups.items()}
