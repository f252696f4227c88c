"""One pass commits everything: a state's hash whose parameter digests are BLAKE3 trees that open.

The state hash (``witness.bundle.state``) is an RFC 6962 tree over one leaf per tensor, a leaf naming
the tensor's BLAKE3 digest. BLAKE3 is itself a tree of 1 KiB chunks (``witness.commit.blake3tree``),
so that one hash already commits every chunk of every parameter: a chunk is opened by

1. its BLAKE3 path: the sibling chaining values from the chunk to its tensor's digest;
2. the tensor's leaf, which the verifier builds from the task's own model (name, dtype, shape) and
   that digest, and its RFC 6962 audit path up to the record's ``state_hash``.

The leaf's place is fixed: the state's names sorted, the model's (``model.*``) first, so a parameter's
index is its place among the model's own state names, and the tree's size is the record's
``state_leaves``, signed before the window's draw. With both fixed, one root holds one digest per
tensor, and a trainer cannot keep two versions of a tensor to open whichever a draw favours.

``StateTree`` is the trainer's side: the state's hash computed once, the parameters with the native
tree (its upper levels kept for the paths), the rest with the ``blake3`` package, which gives the
same digests. ``tree_paths`` checks many openings at once for the verifier.
"""

from __future__ import annotations

import numpy as np
import torch

from ..commit import blake3tree
from ..commit.merkle import MerkleTree, root_from_inclusion
from ..errors import MalformedInput
from ..fingerprint.chunks import ChunkLayout
from .state import _PARALLEL_BYTES, _raw, leaf, on_threads, parse_digest, tensor_digest

TREE = "blake3"  # the manifest's online.tree: chunks open into the state hash's own BLAKE3 digests


def _threads(nbytes: int) -> int:
    """Threads for one tensor's tree: a large one spreads its chunks, as the package's digest does."""
    return torch.get_num_threads() if nbytes >= _PARALLEL_BYTES else 1


class StateTree:
    """A state's hash, with what opens its parameters' chunks: each parameter's BLAKE3 tree, and the
    state tree's leaves. ``flat`` is the layout's buffer holding the parameters (the ring's copy), whose
    bytes are hashed in place and read again for a path; without one, the tensors' own bytes are."""

    def __init__(self, tensors: dict[str, torch.Tensor], digest: str, layout: ChunkLayout,
                 flat: torch.Tensor | None = None):
        if parse_digest(digest) != (TREE, 1) or layout.shards != 1 or layout.chunk_bytes != blake3tree.CHUNK:
            raise ValueError("the one-pass state tree needs BLAKE3 digests of whole tensors and 1 KiB chunks")
        self.layout, self.digest = layout, digest
        views = layout.views(flat) if flat is not None else {}
        self._bytes = {n: _raw(views[n] if n in views else tensors[n]) for n in layout.names}

        def one(name: str, t: torch.Tensor) -> blake3tree.TensorTree | str:
            raw = self._bytes.get(name)
            if raw is None:
                return tensor_digest(t, digest)  # not opened: the package's digest (the same bytes)
            return blake3tree.TensorTree(raw, _threads(raw.nbytes))

        got = on_threads(tensors, one)
        self.names = sorted(tensors)
        self.trees = {n: v for n, v in got.items() if isinstance(v, blake3tree.TensorTree)}
        leaves = [leaf(n, tensors[n].dtype, tensors[n].shape, digest,
                       got[n].digest.hex() if n in self.trees else got[n]) for n in self.names]
        self._tree = MerkleTree(leaves)
        self.root = self._tree.root()
        self.size = len(leaves)
        self._index = {n: i for i, n in enumerate(self.names)}

    def paths(self, chunks: list[int]) -> np.ndarray:
        """The openings' nodes of chunks ``chunks`` (layout indices), one after the other: each
        chunk's BLAKE3 path, then its tensor's audit path in the state tree ([nodes, 32])."""
        out = []
        for c in chunks:
            i = int(self.layout.tensor_of(np.asarray(c)))
            name = self.layout.tensors[i][0]
            out.append(self.trees[name].path(c - self.layout.starts[i], self._bytes[name]))
            proof = self._tree.inclusion_proof(self._index[name])
            out.append(np.frombuffer(b"".join(proof), np.uint8).reshape(-1, 32))
        return np.concatenate(out) if out else np.zeros((0, 32), np.uint8)


class ModelLeaves:
    """What a verifier knows of a state tree's parameter leaves from the task's own model: each layout
    tensor's dtype, shape and place among the model's state names (sorted: they come first)."""

    def __init__(self, model: torch.nn.Module, layout: ChunkLayout):
        sd = model.state_dict()
        names = sorted(f"model.{k}" for k in sd)
        self.count = len(names)  # a state tree holds at least these leaves
        where = {n: i for i, n in enumerate(names)}
        self.layout = layout
        self.index = np.array([where[n] for n in layout.names], np.int64)
        self.meta = [(sd[n[6:]].dtype, tuple(sd[n[6:]].shape)) for n in layout.names]
        self.chunk_count = np.array([blake3tree.chunk_count(layout.nbytes(i)) for i in range(len(layout.names))],
                                    np.int64)

    def lengths(self, chunks: np.ndarray, leaves: np.ndarray) -> np.ndarray:
        """The nodes of each opening (chunk ``chunks[r]`` of a state tree of ``leaves[r]`` leaves)."""
        tensor = self.layout.tensor_of(chunks)
        local = chunks - np.asarray(self.layout.starts)[tensor]
        out = blake3tree.path_lengths(local, self.chunk_count[tensor])
        return out + np.array([_audit_length(int(i), int(n)) for i, n in zip(self.index[tensor], leaves, strict=True)],
                              np.int64)


def _audit_length(index: int, size: int) -> int:
    """The nodes of leaf ``index``'s RFC 6962 audit path in a tree of ``size`` leaves."""
    if not 0 <= index < size:
        return 0  # no such leaf: the opening fails where its root is checked
    n, fn, sn = 0, index, size - 1
    while sn:  # root_from_inclusion's walk: one node a level, the right edge's levels skipped
        n += 1
        if fn & 1 or fn == sn:
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        fn, sn = fn >> 1, sn >> 1
    return n


def tree_paths(leaves: ModelLeaves, digest: str, data: np.ndarray, chunks: np.ndarray, sizes: np.ndarray,
               nodes: np.ndarray, starts: np.ndarray) -> list[bytes | None]:
    """The state root each of R openings leads to (None: its leaf has no place in a tree of that size):
    ``data`` [R, 1024] the chunks (zero past their tensor's end), ``chunks`` [R] their layout indices,
    ``sizes`` [R] the leaves of the state tree each opens into (its record's), ``nodes`` every path's
    nodes and ``starts`` where each opening's begin (its length is ``leaves.lengths``)."""
    layout = leaves.layout
    tensor = layout.tensor_of(chunks)
    local = chunks - np.asarray(layout.starts)[tensor]
    ends = np.array([layout.nbytes(int(i)) for i in tensor], np.int64)
    lengths = np.clip(ends - local * blake3tree.CHUNK, 0, blake3tree.CHUNK)
    count = leaves.chunk_count[tensor]
    digests = blake3tree.path_roots(data, lengths, local, count, nodes, starts)
    below = blake3tree.path_lengths(local, count)
    out: list[bytes | None] = []
    for r in range(len(chunks)):
        i, size = int(tensor[r]), int(sizes[r])
        index = int(leaves.index[i])
        if not index < size:
            out.append(None)
            continue
        dtype, shape = leaves.meta[i]
        at = int(starts[r] + below[r])
        proof = [nodes[j].tobytes() for j in range(at, at + _audit_length(index, size))]
        out.append(root_from_inclusion(leaf(layout.names[i], dtype, shape, digest, digests[r].tobytes().hex()),
                                       index, size, proof))
    return out


def check_tree_settings(online: dict, digest: str) -> None:
    """A manifest's one-pass tree settings: BLAKE3 digests of whole tensors, 1 KiB chunks."""
    if online.get("tree") != TREE:
        raise MalformedInput(f"online.tree must be {TREE!r}")
    if online.get("chunk_bytes") != blake3tree.CHUNK:
        raise MalformedInput(f"online.chunk_bytes must be {blake3tree.CHUNK}: a BLAKE3 chunk")
    if parse_digest(digest)[0] != TREE:
        raise MalformedInput("a run whose chunks open into the state hash hashes its states with BLAKE3")
