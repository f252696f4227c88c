"""The parameters of a training state as fixed-size chunks: their layout, a flat buffer that holds
them chunk-aligned, and the chunk tree whose root an online run's records commit at every step.

The layout is every parameter of the model (its state name ``model.<name>``, dtype and shape),
sorted by name, each starting on a chunk boundary and zero-padded to a whole number of chunks. The
trainer's ring keeps a state's parameters in such a buffer, so the chunks are hashed where they were
copied; a verifier lays out the tensors it loads the same way. The layout's id (a hash of the chunk
size and every tensor's name, dtype and shape) is bound into the root.

Tied weights (one tensor under several state names: nanoGPT's and Hugging Face's tied embedding and
output head) are one alias group (``alias_groups``, from the model itself, never from a bundle). The
layout lays each group out once, under its first name; the state hash holds every name, and a state
whose names of one group hold different bytes is refused wherever it is loaded (``bundle.state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..commit.chunks import ChunkTree, chunk_indices, chunk_leaves
from ..commit.hashing import canonical_json, tagged_hash

DEFAULT_CHUNK_BYTES = 1024
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64, 1 << 20


def _storage_key(t: torch.Tensor) -> tuple:
    """Where a tensor's bytes lie: two state names with one key are one tensor (tied)."""
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: the shard this process holds
    if local.device.type == "meta" or local.numel() == 0:  # no bytes (meta tensors all point at 0)
        return ("id", id(t))
    size = local.element_size()
    return (str(local.device), local.untyped_storage().data_ptr(), local.storage_offset() * size, size,
            tuple(t.shape), tuple(local.shape), local.stride())


def alias_groups(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """The state names (``model.<state_dict key>``) that are one tensor in ``model`` (tied weights):
    groups of two or more, each in ``state_dict`` order. Same storage, offset, shape and stride, so
    a parameter and a buffer, or two parameter objects, that share their bytes are tied too."""
    groups: dict[tuple, list[str]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(_storage_key(t), []).append(f"model.{k}")
    return [tuple(g) for g in groups.values() if len(g) > 1]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the layout's id and messages spell it (``float32``)."""
    return str(dtype).removeprefix("torch.")


def shard_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """The rows ``[start, end)`` of each shard: FSDP2's chunks of ceil(rows / shards) rows."""
    size = -(-rows // shards)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(shards)]


@dataclass(frozen=True)
class ChunkLayout:
    """Where each parameter lies among the chunks: ``tensors`` (name, dtype, shape), sorted by name,
    and ``starts``, the first chunk of each.

    A run over W ranks lays out each rank's rows of the parameters (``of_shards``): rank r's pieces,
    sorted by name, fill chunks ``r·P .. (r + 1)·P``, P the same power of two for every rank (the
    last ones zero), so that each rank's chunks are a whole subtree of the chunk tree, which that
    rank hashes on its own; ``rows`` then names each piece's rows of its parameter."""

    chunk_bytes: int
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    starts: tuple[int, ...]
    size: int  # chunks in all
    rows: tuple[tuple[int, int] | None, ...] | None = None  # each piece's rows of its parameter (over ranks)
    shards: int = 1
    shard_size: int = 0  # P: chunks per rank (over ranks)

    @classmethod
    def of(cls, params: dict[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChunkLayout:
        """The layout of named parameters (``model.<name>``), sorted by name."""
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"a chunk is a power of two from {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES} bytes")
        tensors, starts, at = [], [], 0
        for name in sorted(params):
            t = params[name]
            tensors.append((name, t.dtype, tuple(t.shape)))
            starts.append(at)
            at += -(-t.numel() * t.element_size() // chunk_bytes)
        if at == 0:
            raise ValueError("the model has no parameters to lay out in chunks")
        return cls(chunk_bytes, tuple(tensors), tuple(starts), at)

    @classmethod
    def of_shards(cls, params: dict[str, torch.Tensor], shards: int,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChunkLayout:
        """The layout of named parameters held over ``shards`` ranks, each rank's rows (the sharded
        state digest's split; a 0-dimensional parameter on rank 0) in a subtree of its own."""
        whole = cls.of(params, chunk_bytes)  # checks the chunk size, and that there is something to lay out
        pieces: list[list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, int] | None, int]]] = []
        for r in range(shards):
            mine, at = [], 0
            for name, dtype, shape in whole.tensors:
                if not shape:
                    if r == 0:
                        mine.append((name, dtype, shape, None, at))
                        at += -(-torch.empty((), dtype=dtype).element_size() // chunk_bytes)
                    continue
                a, b = shard_rows(shape[0], shards)[r]
                if a == b:  # no rows on this rank: no bytes
                    continue
                piece = (b - a, *shape[1:])
                mine.append((name, dtype, piece, (a, b), at))
                at += -(-int(np.prod(piece, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
                        // chunk_bytes)
            pieces.append(mine)
            pieces[-1].append(("", torch.uint8, (), None, at))  # (its chunks in all)
        top = max(p[-1][-1] for p in pieces)
        size = 1 << max(top - 1, 0).bit_length()  # the same power of two for every rank
        entries = [(e, r * size + e[4]) for r, p in enumerate(pieces) for e in p[:-1]]
        return cls(chunk_bytes, tuple((n, d, s) for (n, d, s, _, _), _ in entries), tuple(at for _, at in entries),
                   shards * size, tuple(e[3] for e, _ in entries), shards, size)

    @cached_property
    def holding(self) -> tuple[int, ...]:
        """The chunks that hold parameter bytes, ascending: every chunk of a layout in one process;
        over ranks, not the zero chunks that pad each rank's to ``shard_size``."""
        if self.shards == 1:
            return tuple(range(self.size))
        return tuple(c for i, at in enumerate(self.starts) for c in range(at, at + -(-self.nbytes(i) // self.chunk_bytes)))

    def select(self, beta: bytes, k: int) -> list[int]:
        """The chunks a window's ``beta`` opens: ``k`` of those that hold bytes (over ranks, the zero
        chunks open nothing, so they are never drawn: a swap moves every chunk that holds bytes)."""
        held = self.holding
        return [held[j] for j in chunk_indices(beta, k, len(held))]

    def shard(self, rank: int) -> ChunkLayout:
        """Rank ``rank``'s own layout of its pieces (its ``shard_size`` chunks), as it holds them."""
        lo = rank * self.shard_size
        keep = [i for i, at in enumerate(self.starts) if lo <= at < lo + self.shard_size]
        return ChunkLayout(self.chunk_bytes, tuple(self.tensors[i] for i in keep),
                           tuple(self.starts[i] - lo for i in keep), self.shard_size)

    @classmethod
    def of_model(cls, model: torch.nn.Module, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shards: int = 1) -> ChunkLayout:
        """The layout of a model's parameters: each alias group (``alias_groups``: tied weights) once,
        under the first of its parameter names in ``state_dict`` order.

        For weights tied as one ``Parameter`` (nanoGPT's ``transformer.wte.weight`` and
        ``lm_head.weight``) that is the name ``named_parameters()`` gives. The group's other names
        are left out: a state is loaded only where every name of a group holds the same bytes
        (``bundle.state.check_aliases``), so the first name's chunks are the whole group's."""
        params: dict[str, torch.Tensor] = {}
        seen: set[tuple] = set()
        for n, p in model.named_parameters(remove_duplicate=False):
            key = _storage_key(p)
            if key not in seen:
                seen.add(key)
                params[f"model.{n}"] = p
        return cls.of(params, chunk_bytes) if shards == 1 else cls.of_shards(params, shards, chunk_bytes)

    @cached_property
    def id(self) -> bytes:
        """The layout's hash: the chunk size and every tensor's name, dtype and shape, in order."""
        over = {"shards": self.shards, "shard_size": self.shard_size,
                "rows": [list(r) if r else None for r in self.rows or ()]} if self.shards > 1 else {}
        return tagged_hash("witness/chunk-layout/v1", canonical_json(
            {"chunk_bytes": self.chunk_bytes,
             "tensors": [[n, dtype_name(d), list(s)] for n, d, s in self.tensors]} | over))

    @property
    def names(self) -> list[str]:
        """The parameters' state names, in layout order."""
        return [n for n, _, _ in self.tensors]

    @cached_property
    def _sizes(self) -> tuple[tuple[int, int], ...]:
        """(element size, bytes without padding) of each tensor."""
        out = []
        for _, dtype, shape in self.tensors:
            size = torch.empty((), dtype=dtype).element_size()
            out.append((size, int(np.prod(shape, dtype=np.int64)) * size))
        return tuple(out)

    def nbytes(self, i: int) -> int:
        """The bytes of tensor ``i`` (without its padding)."""
        return self._sizes[i][1]

    @cached_property
    def ends(self) -> np.ndarray:
        """Where each tensor's bytes end in a flat buffer (its padding follows, to the next chunk)."""
        return np.array([self.starts[i] * self.chunk_bytes + n for i, (_, n) in enumerate(self._sizes)], np.int64)

    def empty(self, pinned: bool = False) -> torch.Tensor:
        """A zeroed flat buffer for one state's parameters (its padding stays zero)."""
        return torch.zeros(self.size * self.chunk_bytes, dtype=torch.uint8, pin_memory=pinned)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a tensor viewing its place in ``flat``."""
        out = {}
        for i, (name, dtype, shape) in enumerate(self.tensors):
            lo = self.starts[i] * self.chunk_bytes
            out[name] = flat[lo:lo + self.nbytes(i)].view(dtype).view(shape)
        return out

    def misfit(self, state: dict[str, torch.Tensor]) -> str | None:
        """What keeps a whole state's parameters from this layout (one process's): a parameter missing,
        or of another dtype or shape; None if nothing."""
        for name, dtype, shape in self.tensors:
            t = state.get(name)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                return f"the state's {name} is not the layout's ({dtype_name(dtype)}, {list(shape)})"
        return None

    def flatten(self, state: dict[str, torch.Tensor], flat: torch.Tensor | None = None) -> torch.Tensor:
        """The state's parameters in a flat buffer (``flat``, zero-padded, or a new one); a state
        without one of them, or with another dtype or shape, is refused."""
        flat = self.empty() if flat is None else flat
        for i, (name, dtype, shape) in enumerate(self.tensors):
            t = state.get(name)
            rows = self.rows[i] if self.rows is not None else None
            if t is not None and rows is not None:  # a rank's rows of a whole tensor
                t = t[rows[0]:rows[1]] if t.dim() and t.shape[0] >= rows[1] else None
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"the state's {name} is not the layout's ({dtype_name(dtype)}, {list(shape)})")
            lo = self.starts[i] * self.chunk_bytes
            flat[lo:lo + self._sizes[i][1]].copy_(t.detach().reshape(-1).view(torch.uint8))
        return flat

    def tree(self, flat: torch.Tensor) -> ChunkTree:
        """The chunk tree of a flat buffer this layout filled."""
        raw = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
        return ChunkTree(chunk_leaves(raw, self.chunk_bytes), self.id)

    def root(self, state: dict[str, torch.Tensor]) -> bytes:
        """The ``param_root`` of a state's parameters."""
        return self.tree(self.flatten(state)).root

    def tensor_of(self, chunks: np.ndarray) -> np.ndarray:
        """The index of the tensor each chunk belongs to."""
        return np.searchsorted(np.asarray(self.starts), chunks, side="right") - 1

    def locate(self, chunk: int) -> tuple[int, int, int]:
        """(tensor index, its first element in the chunk, how many of its elements the chunk holds)."""
        i = int(self.tensor_of(np.asarray(chunk)))
        size = self._sizes[i][0]
        first = (chunk - self.starts[i]) * self.chunk_bytes // size
        return i, first, min(self.chunk_bytes // size, self.nbytes(i) // size - first)
