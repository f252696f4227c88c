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
from ..commit.batch import node_hashes
from ..commit.chunks import path_nodes
from ..commit.hashing import leaf_hash
from ..commit.merkle import MerkleTree, merkle_root
from ..errors import MalformedInput
from ..fingerprint.chunks import ChunkLayout
from .openings import MAX_OPENINGS_BYTES
from .state import (
    _PARALLEL_BYTES,
    _leaf_template,
    _raw,
    bytes_digest,
    leaf,
    on_threads,
    parse_digest,
    state_hash,
)

TREE = "blake3"  # the manifest's online.tree: chunks open into the state hash's own BLAKE3 digests
_SMALL = 256 << 10  # a tensor of at most this many bytes is hashed with the others in one call
_NONE = 64  # a level above any tensor's: its tree keeps no level (its digest alone)


def _threads(nbytes: int) -> int:
    """Threads for one tensor's tree: a large one spreads its chunks, as the package's digest does."""
    return torch.get_num_threads() if nbytes >= _PARALLEL_BYTES else 1


def host_digests(tensors: dict[str, torch.Tensor], raws: dict[str, np.ndarray], name: str,
                 opened: frozenset[str] | set[str] = frozenset()) -> tuple[dict[str, str], dict[str, blake3tree.TensorTree]]:
    """Each tensor's hex digest with hash ``name``, from its bytes ``raws``, on the host's threads; with BLAKE3,
    also the trees of the ``opened`` tensors, whose chunks the every-step check opens."""
    if name != TREE:
        return on_threads(tensors, lambda n, _: bytes_digest(raws[n], name)), {}
    # the small ones in one native call, where a call each would cost more than their bytes (an opened one's
    # tree with its levels kept from KEEP_FROM up); the rest by the package (faster per byte) or a native tree
    # each, on the host's threads
    batch = [n for n in tensors if raws[n].nbytes <= _SMALL]
    got = blake3tree.trees([raws[n] for n in batch], [blake3tree.KEEP_FROM if n in opened else _NONE for n in batch])
    hexes, trees = {}, {}
    for n, (digest, kept) in zip(batch, got, strict=True):
        hexes[n] = digest.hex()
        if n in opened:
            trees[n] = blake3tree.TensorTree.from_parts(blake3tree.chunk_count(raws[n].nbytes), digest, kept)

    def one(n: str, _: torch.Tensor) -> blake3tree.TensorTree | str:
        raw = raws[n]
        return blake3tree.TensorTree(raw, _threads(raw.nbytes)) if n in opened else bytes_digest(raw, TREE)

    for n, v in on_threads({n: t for n, t in tensors.items() if n not in hexes}, one).items():
        if isinstance(v, blake3tree.TensorTree):
            trees[n], hexes[n] = v, v.digest.hex()
        else:
            hexes[n] = v
    return hexes, trees


class SlotPlan:
    """What hashing a ring slot takes, worked out once: a slot's tensors stay the same buffers from one
    kept state to the next, so their bytes' views, their order and their leaves' JSON around the digest
    are found once, and each state then costs its hashes alone."""

    def __init__(self, tensors: dict[str, torch.Tensor], digest: str):
        self.tensors, self.digest = tensors, digest
        self.names = sorted(tensors)
        self.raws = {n: _raw(tensors[n]) for n in self.names}
        self._around = [_leaf_template(n, tensors[n].dtype, tuple(tensors[n].shape), digest) for n in self.names]

    def leaves(self, hexes: dict[str, str]) -> list[bytes]:
        """The state tree's leaves, in name order, from each tensor's hex digest."""
        return [leaf_hash(a[0] + hexes[n].encode("ascii") + a[1]) if a is not None else
                leaf(n, self.tensors[n].dtype, self.tensors[n].shape, self.digest, hexes[n])
                for n, a in zip(self.names, self._around, strict=True)]

    def state_hash(self) -> bytes:
        """The slot's state hash now (``witness.bundle.state.state_hash``'s, without its work per tensor)."""
        name, shards = parse_digest(self.digest)
        if shards != 1:
            return state_hash(self.tensors, self.digest)
        return merkle_root(self.leaves(host_digests(self.tensors, self.raws, name)[0]))


class TensorTrees:
    """Tensors hashed once: every tensor's digest (``hex``), and the BLAKE3 tree of each of ``layout``'s
    tensors (the parameters, or one rank's pieces of them), whose chunks it opens. ``flat`` is the
    layout's buffer holding them (the ring's copy), hashed in place and read again for a path; without
    one, the tensors' own bytes are. ``plan``: the slot's, where ``tensors`` is a ring slot."""

    def __init__(self, tensors: dict[str, torch.Tensor], layout: ChunkLayout, flat: torch.Tensor | None = None,
                 hasher: str = "host", plan: SlotPlan | None = None):
        """``hasher``: "host" (the native tree and the package, on the host's threads) or "cuda" (the Triton
        kernels where ``tensors`` lie; ``flat``, the host copy, then gives the bytes a path reads)."""
        if layout.shards != 1 or layout.chunk_bytes != blake3tree.CHUNK:
            raise ValueError("the one-pass state tree needs BLAKE3 digests of whole tensors and 1 KiB chunks")
        self.layout = layout
        if plan is not None:  # (the slot's views: the same bytes as the buffer's, where the slot's tensors lie)
            self._bytes = {n: plan.raws[n] for n in layout.names}
        elif flat is not None:  # the buffer's bytes where each tensor lies (numpy slices: no tensor views a step)
            raw = flat.numpy()
            self._bytes = {n: raw[a:e] for n, a, e in zip(layout.names, np.asarray(layout.starts) * layout.chunk_bytes,
                                                          layout.ends, strict=True)}
        else:
            self._bytes = {n: _raw(tensors[n]) for n in layout.names}

        # on a GPU the kernels hash what lies there; what a state keeps on the host (AdamW's step counters, a
        # loss scale) is hashed on the host
        host = tensors if hasher == "host" else {n: t for n, t in tensors.items() if not on_gpu(t)}
        got: dict[str, blake3tree.TensorTree | str] = {n: _on_device(n in self._bytes, t) for n, t in tensors.items()
                                                       if n not in host}
        raws = plan.raws if plan is not None else {n: self._bytes.get(n) if n in self._bytes else _raw(t)
                                                   for n, t in host.items()}
        hexes, self.trees = host_digests(host, raws, TREE, self._bytes.keys() & host.keys())
        self.trees |= {n: v for n, v in got.items() if isinstance(v, blake3tree.TensorTree)}
        self.hex = hexes | {n: v.digest.hex() if isinstance(v, blake3tree.TensorTree) else v for n, v in got.items()}

    def name(self, chunk: int) -> str:
        """The tensor a layout chunk belongs to."""
        return self.layout.tensors[int(self.layout.tensor_of(np.asarray(chunk)))][0]

    def raw(self, name: str) -> np.ndarray:
        """The bytes of one of the layout's tensors, as hashed (the ring's copy, where it holds the state)."""
        return self._bytes[name]

    def path(self, chunk: int) -> np.ndarray:
        """Layout chunk ``chunk``'s BLAKE3 path, up to its tensor's digest ([nodes, 32])."""
        i = int(self.layout.tensor_of(np.asarray(chunk)))
        name = self.layout.tensors[i][0]
        return self.trees[name].path(chunk - self.layout.starts[i], self._bytes[name])


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the kernels hash this tensor of a state hashed by "cuda" (a test under Triton's interpreter
    puts CPU tensors there)."""
    return t.device.type == "cuda"


class DeviceTree(blake3tree.TensorTree):
    """A tensor's tree hashed on its GPU: its levels from ``KEEP_FROM`` up stay there, as long as the ring
    holds the state, and a path copies its few nodes of them to the host."""

    def __init__(self, nbytes: int, digest: bytes, levels: list[torch.Tensor]):
        self.size, self.keep_from, self.digest = blake3tree.chunk_count(nbytes), blake3tree.KEEP_FROM, digest
        self.levels = levels[blake3tree.KEEP_FROM:]  # [m, 8] int32 CV words a level, on the device

    def kept_nodes(self, wanted: list[tuple[int, int]]) -> np.ndarray:
        """The wanted nodes, gathered on the device and copied over in one transfer."""
        from ..fingerprint import b3gpu

        if not wanted:
            return np.zeros((0, 32), np.uint8)
        picked = torch.stack([self.levels[lv - self.keep_from][pos] for lv, pos in wanted])
        return np.frombuffer(b3gpu.cv_bytes(picked), np.uint8).reshape(-1, 32)


def _on_device(opened: bool, t: torch.Tensor) -> blake3tree.TensorTree | str:
    """A tensor hashed where it lies by the Triton kernels: its tree (its upper levels kept there) where
    its chunks are opened, else its digest; only the digest crosses to the host."""
    from ..fingerprint import b3gpu

    digest, levels = b3gpu.tensor_tree(t)
    return DeviceTree(t.numel() * t.element_size(), digest, levels) if opened else digest.hex()


def hasher_for(device: torch.device) -> str:
    """Where a state on ``device`` is hashed: on a CUDA device by the Triton kernels where Triton is
    installed (the recorder records it as ``hashed_by``), else on the host."""
    from ..fingerprint import b3gpu

    return "cuda" if device.type == "cuda" and b3gpu.available() else "host"


def _nodes(hashes: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, 32)


class StateLeaves:
    """A state tree over leaves sorted by name: its root (the state hash), its size and each name's audit
    path (``StateTree`` in one process, ``ShardedState`` over ranks)."""

    def __init__(self, names: list[str], leaves: list[bytes]):
        self._tree = MerkleTree(leaves)
        self.root = self._tree.root()
        self.size = len(leaves)
        self._index = {n: i for i, n in enumerate(names)}

    def audit(self, name: str) -> np.ndarray:
        """The audit path of ``name``'s leaf ([nodes, 32]): its siblings read off the tree's levels (the
        RFC 6962 tree of the whole size, whose odd last node goes up unchanged)."""
        i = self._index[name]
        return _nodes([self._tree.levels[level][pos] for level, pos in path_nodes(i, self.size)])


class StateTree(StateLeaves):
    """A state's hash in one process, with what opens its parameters' chunks: each parameter's BLAKE3
    tree (``TensorTrees``) and the state tree's leaves."""

    def __init__(self, tensors: dict[str, torch.Tensor], digest: str, layout: ChunkLayout,
                 flat: torch.Tensor | None = None, hasher: str = "host", plan: SlotPlan | None = None):
        """``plan``: the ring slot's that ``tensors`` is (hashed with this digest), else None."""
        if parse_digest(digest) != (TREE, 1) or (plan is not None and (plan.tensors is not tensors
                                                                       or plan.digest != digest)):
            raise ValueError("the one-pass state tree needs BLAKE3 digests of whole tensors and 1 KiB chunks")
        self.layout, self.pieces = layout, TensorTrees(tensors, layout, flat, hasher, plan)
        names = sorted(tensors)
        super().__init__(names, plan.leaves(self.pieces.hex) if plan is not None else
                         [leaf(n, tensors[n].dtype, tensors[n].shape, digest, self.pieces.hex[n]) for n in names])

    def tail(self, name: str) -> np.ndarray:
        """What follows a chunk's BLAKE3 path in its opening: its tensor's audit path."""
        return self.audit(name)

    def paths(self, chunks: list[int]) -> np.ndarray:
        """The openings' nodes of chunks ``chunks`` (layout indices), one after the other: each
        chunk's BLAKE3 path, then its tensor's audit path in the state tree ([nodes, 32])."""
        out = [x for c in chunks for x in (self.pieces.path(c), self.tail(self.pieces.name(c)))]
        return np.concatenate(out) if out else np.zeros((0, 32), np.uint8)


def window_paths(trees: list[StateTree], chunks: list[int]) -> list[np.ndarray]:
    """What ``StateTree.paths(chunks)`` gives for each of a window's states, for all of them at once: the
    chunks are the same in each state, so their paths have the same shape, and the levels above each
    chunk's block of ``2 ** KEEP_FROM`` chunks are hashed in every state in one call."""
    alike = [t for t in trees if t._index == trees[0]._index and t.layout is trees[0].layout]
    if len(alike) < len(trees):  # (the initial state, without the optimizer's moments, has fewer leaves)
        done = dict(zip(map(id, alike), window_paths(alike, chunks), strict=True))
        return [done[id(t)] if id(t) in done else t.paths(chunks) for t in trees]
    out: list[list[np.ndarray]] = [[] for _ in trees]
    for c in chunks:
        layout = trees[0].layout
        i = int(layout.tensor_of(np.asarray(c)))
        name, j = layout.tensors[i][0], c - int(layout.starts[i])
        kept = [t.pieces.trees[name] for t in trees]
        size, keep_from = kept[0].size, kept[0].keep_from
        lo = j >> keep_from << keep_from
        hi = min(size, lo + (1 << keep_from))
        level = np.stack([np.frombuffer(blake3tree.chunk_cvs(t.pieces.raw(name)[lo * blake3tree.CHUNK:
                                                                            hi * blake3tree.CHUNK], lo), np.uint8)
                          for t in trees]).reshape(len(trees), hi - lo, 32)
        levels = [level]  # the block's own levels in every state ([states, nodes, 32])
        while len(levels) < keep_from and levels[-1].shape[1] > 1:
            lv = levels[-1]
            even = lv.shape[1] // 2 * 2
            up = np.frombuffer(blake3tree.parents(np.ascontiguousarray(lv[:, :even]).tobytes()), np.uint8)
            levels.append(np.concatenate([up.reshape(len(trees), even // 2, 32), lv[:, even:]], axis=1))
        nodes = [levels[lv][:, pos - (lo >> lv)] if lv < keep_from else np.stack([k.kept(lv, pos) for k in kept])
                 for lv, pos in path_nodes(j, size)]
        path = np.stack(nodes, axis=1) if nodes else np.zeros((len(trees), 0, 32), np.uint8)  # [states, nodes, 32]
        audit = path_nodes(trees[0]._index[name], trees[0].size)  # (the same leaf of a tree of the same size)
        for s, t in enumerate(trees):
            out[s] += [path[s], _nodes([t._tree.levels[lv][pos] for lv, pos in audit])]
    return [np.concatenate(x) if x else np.zeros((0, 32), np.uint8) for x in out]


class ShardedState(StateLeaves):
    """Rank 0's view of a state hashed over W ranks (a ``blake3/W`` digest): every rank's digests of its
    row pieces (``ranks``, rank order), the state tree they make, and what follows a piece's BLAKE3 path
    in an opening: the tensor's W shard digests (none for a 0-dimensional one), then its audit path."""

    def __init__(self, meta: dict[str, tuple[torch.dtype, tuple[int, ...]]], ranks: list[dict[str, str]],
                 digest: str):
        name, shards = parse_digest(digest)
        if name != TREE or len(ranks) != shards or any(set(r) != set(meta) for r in ranks):
            raise ValueError("every rank hashes a piece of every tensor of the state, with BLAKE3")
        names = sorted(meta)
        self._shards = {n: _nodes([bytes.fromhex(r[n]) for r in ranks]) for n in names if meta[n][1]}
        leaves = []
        for n in names:
            dtype, shape = meta[n]
            d = blake3tree.digest(self._shards[n].tobytes()).hex() if shape else ranks[0][n]
            leaves.append(leaf(n, dtype, shape, digest, d))
        super().__init__(names, leaves)

    def tail(self, name: str) -> np.ndarray:
        """The tensor's shard digests (if it is split by rows), then its audit path."""
        audit = self.audit(name)
        return np.concatenate([self._shards[name], audit]) if name in self._shards else audit


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
        self.nbytes = np.array([layout.nbytes(i) for i in range(len(layout.names))], np.int64)
        self.chunk_count = np.array([blake3tree.chunk_count(int(b)) for b in self.nbytes], np.int64)
        # over W ranks (a sharded digest): each piece's rank, and how many shard digests its opening holds
        # (W for a tensor split by rows; none for a 0-dimensional one, hashed whole on rank 0)
        self.rank = np.array([at // layout.shard_size if layout.shards > 1 else 0 for at in layout.starts], np.int64)
        self.shards = np.array([layout.shards if layout.shards > 1 and shape else 0 for _, shape in self.meta],
                               np.int64)
        self._lengths: dict[tuple[bytes, bytes], np.ndarray] = {}

    def lengths(self, chunks: np.ndarray, leaves: np.ndarray) -> np.ndarray:
        """The nodes of each opening (chunk ``chunks[r]`` of a state tree of ``leaves[r]`` leaves)."""
        key = (np.asarray(chunks).tobytes(), np.asarray(leaves).tobytes())
        if key not in self._lengths:  # (a window's states open the same chunks in trees of one size, mostly)
            if len(self._lengths) > 4096:
                self._lengths.clear()
            self._lengths[key] = self._count(chunks, leaves)
        return self._lengths[key]

    def _count(self, chunks: np.ndarray, leaves: np.ndarray) -> np.ndarray:
        tensor = self.layout.tensor_of(chunks)
        local = chunks - np.asarray(self.layout.starts)[tensor]
        out = blake3tree.path_lengths(local, self.chunk_count[tensor]) + self.shards[tensor]
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


def _inclusion_roots(leaves: np.ndarray, index: np.ndarray, size: np.ndarray, nodes: np.ndarray,
                     starts: np.ndarray) -> np.ndarray:
    """``root_from_inclusion`` of R leaves at once ([R, 32]): leaf r at ``index[r]`` of a tree of
    ``size[r]`` leaves, its audit path ``_audit_length`` nodes of ``nodes`` from ``starts[r]``; the walk
    of RFC 9162 §2.1.3.2, one level for all rows at a time."""
    cur = np.array(leaves, dtype=np.uint8, copy=True)
    fn, sn = np.asarray(index, np.int64).copy(), np.asarray(size, np.int64) - 1
    ptr = np.asarray(starts, np.int64).copy()
    while (sn > 0).any():
        rows = np.nonzero(sn > 0)[0]
        sib = nodes[ptr[rows]]
        left = ((fn[rows] & 1) == 1) | (fn[rows] == sn[rows])  # the sibling is on the left
        pairs = np.concatenate([np.where(left[:, None], sib, cur[rows]), np.where(left[:, None], cur[rows], sib)], 1)
        cur[rows] = np.frombuffer(node_hashes(np.ascontiguousarray(pairs)), np.uint8).reshape(-1, 32)
        ptr[rows] += 1
        edge = rows[left]
        while True:  # a right edge's levels: shifted past until the node is a right child (or the root)
            move = edge[((fn[edge] & 1) == 0) & (fn[edge] != 0)]
            if not move.size:
                break
            fn[move] >>= 1
            sn[move] >>= 1
            edge = move
        fn[rows] >>= 1
        sn[rows] >>= 1
    return cur


def tree_paths(leaves: ModelLeaves, digest: str, data: np.ndarray, chunks: np.ndarray, sizes: np.ndarray,
               nodes: np.ndarray, starts: np.ndarray) -> list[bytes | None]:
    """The state root each of R openings leads to (None: its leaf has no place in a tree of that size,
    or its piece is not the shard its rank's digest names): ``data`` [R, 1024] the chunks (zero past
    their tensor's end), ``chunks`` [R] their layout indices, ``sizes`` [R] the leaves of the state tree
    each opens into (its record's), ``nodes`` every path's nodes and ``starts`` where each opening's
    begins (its length is ``leaves.lengths``). Every step for all rows at once but the leaves' JSON."""
    layout = leaves.layout
    tensor = layout.tensor_of(chunks)
    local = chunks - np.asarray(layout.starts)[tensor]
    lengths = np.clip(leaves.nbytes[tensor] - local * blake3tree.CHUNK, 0, blake3tree.CHUNK)
    count = leaves.chunk_count[tensor]
    digests = blake3tree.path_roots(data, lengths, local, count, nodes, starts)
    at = np.asarray(starts, np.int64) + blake3tree.path_lengths(local, count)
    index, sizes = leaves.index[tensor], np.asarray(sizes, np.int64)
    ok = index < sizes
    w = leaves.shards[tensor]
    for r in np.nonzero(w)[0]:  # a piece of rank q: its digest is shard q of the W the tensor's is the hash of
        shards = nodes[at[r]:at[r] + w[r]]
        ok[r] &= shards[leaves.rank[tensor[r]]].tobytes() == digests[r].tobytes()
        digests[r] = np.frombuffer(blake3tree.digest(shards.tobytes()), np.uint8)
    at += w
    hashes = np.frombuffer(b"".join(
        leaf(layout.names[i], *leaves.meta[i], digest, d.tobytes().hex()) for i, d in zip(tensor, digests, strict=True)),
        np.uint8).reshape(-1, 32)
    good = np.nonzero(ok)[0]
    tops = _inclusion_roots(hashes[good], index[good], sizes[good], nodes, at[good])
    out: list[bytes | None] = [None] * len(chunks)
    for j, r in enumerate(good):
        out[r] = tops[j].tobytes()
    return out


# the most nodes an opening holds besides its shard digests: a BLAKE3 path (a tensor of 2^40 chunks) and an
# audit path (2^24 leaves), with room to spare
_PATH_NODES = 64


def check_tree_settings(online: dict, digest: str) -> None:
    """A manifest's one-pass tree settings: BLAKE3 digests (of whole tensors, or of row shards), 1 KiB chunks,
    and a window's openings (each with the W shard digests of a run over W ranks) within what a verifier
    reads of one file."""
    if online.get("tree") != TREE:
        raise MalformedInput(f"online.tree must be {TREE!r}")
    if online.get("chunk_bytes") != blake3tree.CHUNK:
        raise MalformedInput(f"online.chunk_bytes must be {blake3tree.CHUNK}: a BLAKE3 chunk")
    name, shards = parse_digest(digest)
    if name != TREE:
        raise MalformedInput("a run whose chunks open into the state hash hashes its states with BLAKE3")
    per_chunk = blake3tree.CHUNK + 32 * (_PATH_NODES + (shards if shards > 1 else 0))
    if (online["every"] + 1) * online["chunks"] * per_chunk > MAX_OPENINGS_BYTES - (1 << 16):
        raise MalformedInput(f"a window's openings (every + 1 states of chunks, each with its paths and {shards} shard "
                             f"digest(s)) may hold at most {MAX_OPENINGS_BYTES >> 20} MiB: open fewer chunks")
