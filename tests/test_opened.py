"""One pass commits everything (``witness.bundle.opened``): a state tree hashed once is the state hash,
and a chunk's opening leads to it only from its own tensor, state, position and run, with the state
tree's size its record committed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from witness.bundle.opened import ModelLeaves, StateTree, tree_paths
from witness.bundle.state import state_hash, state_tensors
from witness.fingerprint.chunks import ChunkLayout


class Tied(torch.nn.Module):
    """Parameters of several sizes (one tensor of one chunk, others of many, not a power of two), a
    buffer, and an output head tied to the embedding, as nanoGPT's."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(300, 24)
        self.fc = torch.nn.Linear(24, 37)
        self.norm = torch.nn.LayerNorm(37)
        self.head = torch.nn.Linear(24, 300, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.ones(5))


def _state(seed: int = 0, steps: int = 1) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = Tied(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = model.emb(torch.arange(7))
        (model.head(x).sum() + model.norm(model.fc(x)).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    return model, state_tensors(model, opt)


def _open(tree: StateTree, layout: ChunkLayout, tensors: dict, chunks: list[int]):
    """Rows, chunk ids, nodes and starts of ``chunks`` of one state, as an openings file holds them."""
    flat = layout.flatten(tensors)
    data = flat.numpy().reshape(layout.size, 1024)[chunks].copy()
    paths = [tree.paths([c]) for c in chunks]
    starts = np.cumsum([0] + [len(p) for p in paths])[:-1]
    return data, np.asarray(chunks), np.concatenate(paths), starts


def test_the_state_tree_is_the_state_hash_and_opens_every_chunk():
    model, tensors = _state()
    layout = ChunkLayout.of_model(model)
    assert "model.head.weight" not in layout.names  # tied: laid out once, under the embedding's name
    flat = layout.flatten(tensors)
    for with_flat in (flat, None):
        tree = StateTree(tensors, "blake3", layout, with_flat)
        assert tree.root == state_hash(tensors, "blake3") and tree.size == len(tensors)
    leaves = ModelLeaves(model, layout)
    chunks = list(range(layout.size))
    data, ids, nodes, starts = _open(tree, layout, tensors, chunks)
    sizes = np.full(len(chunks), tree.size)
    assert np.array_equal(leaves.lengths(ids, sizes), np.diff(np.append(starts, len(nodes))))
    assert tree_paths(leaves, "blake3", data, ids, sizes, nodes, starts) == [tree.root] * len(chunks)


def test_an_opening_leads_to_the_root_only_from_its_own_chunk_state_and_size():
    model, tensors = _state()
    layout = ChunkLayout.of_model(model)
    leaves = ModelLeaves(model, layout)
    tree = StateTree(tensors, "blake3", layout)
    big = layout.names.index("model.emb.weight")
    c = layout.starts[big] + 5  # a chunk inside a tensor of many
    data, ids, nodes, starts = _open(tree, layout, tensors, [c])

    def top(data=data, ids=ids, nodes=nodes, size=tree.size):  # noqa: ANN001
        need = int(leaves.lengths(ids, np.array([size]))[0])  # as the reader holds it: the length it derives
        nodes = np.concatenate([nodes, np.zeros((max(0, need - len(nodes)), 32), np.uint8)])[:need]
        return tree_paths(leaves, "blake3", data, ids, np.array([size]), nodes, starts)[0]

    assert top() == tree.root
    flipped = data.copy()
    flipped[0, 100] ^= 0x01  # one bit of the chunk
    assert top(data=flipped) != tree.root
    assert top(ids=ids + 1) != tree.root  # its bytes and path claimed as the next chunk's
    # the state tree's size: its committed leaves fix where the tensor's leaf lies (a size whose path has
    # another shape; one of the same shape leads to the same leaf, test_two_sizes_could_hold_two_leaves)
    for size in (2 * tree.size, leaves.count - 1):
        assert top(size=size) != tree.root
    assert tree_paths(leaves, "blake3", data, ids, np.array([0]), nodes, starts) == [None]  # no such leaf
    # another state of the same run (one step on) and another run's state: their paths lead elsewhere
    _, later = _state(steps=2)
    _, other = _state(seed=1)
    for t in (later, other):
        _, _, theirs, _ = _open(StateTree(t, "blake3", layout), layout, t, [c])
        assert top(nodes=theirs) != tree.root
    # a chunk of another tensor opened with this one's path
    fc = layout.names.index("model.fc.weight")
    other_data, _, _, _ = _open(tree, layout, tensors, [layout.starts[fc]])
    assert top(data=other_data) != tree.root


def test_a_tensor_of_one_chunk_opens_into_its_root_flag():
    """A one-chunk tensor's digest is its chunk compressed as the root: its opening holds only the state
    tree's audit path (tests/test_blake3tree.py: the same chunk's chaining value is not the digest)."""
    model, tensors = _state()
    layout = ChunkLayout.of_model(model)
    leaves = ModelLeaves(model, layout)
    tree = StateTree(tensors, "blake3", layout)
    small = layout.names.index("model.fc.bias")  # 37 float32: one chunk
    c = layout.starts[small]
    data, ids, nodes, starts = _open(tree, layout, tensors, [c])
    assert len(nodes) == len(tree.audit("model.fc.bias"))
    assert tree_paths(leaves, "blake3", data, ids, np.array([tree.size]), nodes, starts) == [tree.root]


def test_the_one_pass_refuses_what_it_cannot_open():
    model, tensors = _state()
    with pytest.raises(ValueError, match="BLAKE3 digests of whole tensors and 1 KiB chunks"):
        StateTree(tensors, "sha256", ChunkLayout.of_model(model))
    with pytest.raises(ValueError, match="1 KiB chunks"):
        StateTree(tensors, "blake3", ChunkLayout.of_model(model, 2048))


def test_two_sizes_could_hold_two_leaves_at_one_index_so_the_record_names_one():
    """Why a record commits its state tree's size: a root the trainer builds can hold leaf 2 of a tree of
    5 leaves and another leaf 2 of a tree of 3 (the left subtree of one is a node of the other). With the
    size fixed before the draw, only one of them opens."""
    from witness.commit.hashing import leaf_hash, node_hash
    from witness.commit.merkle import MerkleTree, root_from_inclusion

    honest = [leaf_hash(bytes([i])) for i in range(4)]
    fake = leaf_hash(b"another version of tensor 2")
    left = MerkleTree(honest).root()
    root = node_hash(left, fake)  # honest leaves 0..3, then the fake as leaf 4 of 5
    assert MerkleTree([*honest, fake]).root() == root
    assert root_from_inclusion(honest[2], 2, 5, MerkleTree([*honest, fake]).inclusion_proof(2)) == root
    assert root_from_inclusion(fake, 2, 3, [left]) == root  # read as 3 leaves, index 2 is the fake
    assert root_from_inclusion(fake, 2, 5, MerkleTree([*honest, fake]).inclusion_proof(2)) != root


def test_the_batched_audit_walk_is_rfc6962s_for_every_index_and_size():
    """The verifier walks every opening's audit path at once: the roots are root_from_inclusion's (which
    RFC 6962's vectors check), for every index of every tree size up to 70, right edges included."""
    import os

    from witness.bundle.opened import _inclusion_roots
    from witness.commit.merkle import MerkleTree

    leaves, index, size, nodes, starts, want = [], [], [], [], [], []
    for n in range(1, 70):
        t = MerkleTree([os.urandom(32) for _ in range(n)])
        for i in range(n):
            starts.append(len(nodes))
            nodes += t.inclusion_proof(i)
            leaves.append(t.levels[0][i])
            index.append(i)
            size.append(n)
            want.append(t.root())
    nodes.append(bytes(32))
    arr = lambda xs: np.frombuffer(b"".join(xs), np.uint8).reshape(-1, 32)  # noqa: E731
    got = _inclusion_roots(arr(leaves), np.array(index), np.array(size), arr(nodes), np.array(starts))
    assert [g.tobytes() for g in got] == want
    flipped = arr(nodes).copy()
    flipped[starts[100]] ^= 1
    assert _inclusion_roots(arr(leaves), np.array(index), np.array(size), flipped, np.array(starts))[100].tobytes() \
        != want[100]


def test_over_ranks_each_piece_opens_into_its_shard_digest_and_the_whole_state_hash():
    """Over W ranks (a blake3/W digest) each rank hashes its rows once and keeps its pieces' trees; rank 0
    builds the state tree from every rank's digests, and an opening (the piece's path, the tensor's W shard
    digests, the leaf's audit path) leads to the state hash of the whole tensors. A shard digest that is not
    the piece's, or a piece read as another rank's, leads nowhere."""
    from witness.bundle.opened import ShardedState, TensorTrees
    from witness.fingerprint.chunks import shard_rows

    model, tensors = _state()
    w = 2
    layout = ChunkLayout.of_model(model, 1024, w)
    meta = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    ranks = []
    for r in range(w):
        pieces = {n: t if not t.dim() else t[slice(*shard_rows(t.shape[0], w)[r])] for n, t in tensors.items()}
        mine = layout.shard(r)
        ranks.append((mine, pieces, TensorTrees(pieces, mine, mine.flatten(pieces))))
    state = ShardedState(meta, [t.hex for _, _, t in ranks], f"blake3/{w}")
    assert state.root == state_hash(tensors, f"blake3/{w}") and state.size == len(tensors)
    leaves = ModelLeaves(model, layout)
    chunks = list(layout.holding)
    data, nodes, starts = [], [], []
    for c in chunks:
        r = c // layout.shard_size
        mine, pieces, trees = ranks[r]
        local = c - r * layout.shard_size
        data.append(mine.flatten(pieces).numpy().reshape(mine.size, 1024)[local])
        starts.append(sum(len(x) for x in nodes))
        nodes += [trees.path(local), state.tail(trees.name(local))]
    data, nodes, ids = np.stack(data), np.concatenate(nodes), np.asarray(chunks)
    sizes = np.full(len(chunks), state.size)
    assert np.array_equal(leaves.lengths(ids, sizes), np.diff(np.append(starts, len(nodes))))
    assert tree_paths(leaves, f"blake3/{w}", data, ids, sizes, nodes, np.array(starts)) == [state.root] * len(chunks)
    # one opening of rank 1's rows of the embedding: its shard digest changed, or its own digest and rank 0's swapped
    c = next(i for i, x in enumerate(chunks) if x >= layout.shard_size and layout.tensors[layout.tensor_of(x)][0]
             == "model.emb.weight")
    below = int(blake3tree_lengths(leaves, ids[c:c + 1])[0])
    for change in ("flip", "swap"):
        bad = nodes.copy()
        at = starts[c] + below
        if change == "flip":
            bad[at + 1, 0] ^= 1
        else:
            bad[[at, at + 1]] = bad[[at + 1, at]]
        got = tree_paths(leaves, f"blake3/{w}", data[c:c + 1], ids[c:c + 1], sizes[:1], bad, np.array(starts[c:c + 1]))
        assert got[0] != state.root


def blake3tree_lengths(leaves: ModelLeaves, ids: np.ndarray) -> np.ndarray:
    """The BLAKE3 path's length of each opening (before its shard digests)."""
    from witness.commit.blake3tree import path_lengths

    tensor = leaves.layout.tensor_of(ids)
    return path_lengths(ids - np.asarray(leaves.layout.starts)[tensor], leaves.chunk_count[tensor])


def test_a_window_whose_openings_a_verifier_would_not_read_is_refused_up_front():
    """Over W ranks each opening holds the tensor's W shard digests: the manifest bounds a window's file
    with them (a verifier reads at most 1 GiB of one), so an honest run is never written that it refuses."""
    from witness.bundle.opened import check_tree_settings
    from witness.errors import MalformedInput

    online = {"tree": "blake3", "chunk_bytes": 1024, "every": 10, "chunks": 2}
    check_tree_settings(online, "blake3/8")
    with pytest.raises(MalformedInput, match="may hold at most 1024 MiB"):
        check_tree_settings(online | {"every": 3, "chunks": 65536}, "blake3/128")
    check_tree_settings(online | {"every": 3, "chunks": 65536 // 8}, "blake3/128")


def test_a_ring_slot_hashed_by_its_plan_gives_the_same_hashes_trees_and_paths():
    """The ring hashes its slots with what it worked out once (``SlotPlan``), and opens a window's states
    all at once (``window_paths``): the same state hash, the same leaves and the same openings as a state
    hashed from scratch, for every chunk, including a window that starts at the initial state (fewer
    leaves: no moments yet), whose openings then lead to its own root."""
    from witness.bundle.opened import SlotPlan, window_paths
    from witness.record.kept import StatePool

    model, _ = _state()
    layout = ChunkLayout.of_model(model)
    pool = StatePool(layout)
    initial = {k: v for k, v in _state(steps=0)[1].items() if k.startswith("model.")}
    states = [initial] + [_state(steps=s)[1] for s in (1, 2, 3)]
    trees = []
    for tensors in states:
        slot = pool.copy(tensors)
        plan = pool.plan(slot, "blake3")
        assert pool.plan(slot, "blake3") is plan and pool.plan({}, "blake3") is None
        assert plan.state_hash() == state_hash(tensors, "blake3")
        assert SlotPlan(slot, "sha256").state_hash() == state_hash(tensors, "sha256")
        tree = StateTree(slot, "blake3", layout, pool.flat(slot), plan=plan)
        alone = StateTree(tensors, "blake3", layout)
        assert tree.root == alone.root == state_hash(tensors, "blake3")
        trees.append((tree, alone))
    with pytest.raises(ValueError):  # a plan is its own slot's
        StateTree(states[1], "blake3", layout, plan=plan)
    chunks = list(range(layout.size))
    for got, (tree, alone) in zip(window_paths([t for t, _ in trees], chunks), trees, strict=True):
        assert np.array_equal(got, alone.paths(chunks)) and np.array_equal(got, tree.paths(chunks))
    leaves = ModelLeaves(model, layout)
    for tensors, (tree, _) in zip(states, trees, strict=True):
        data, idx, nodes, starts = _open(tree, layout, tensors, chunks)
        roots = tree_paths(leaves, "blake3", data, idx, np.full(len(idx), tree.size), nodes, starts)
        assert all(r == tree.root for r in roots)


def test_openings_written_from_numpy_are_the_bytes_safetensors_writes():
    """The openings' file is built in memory (no tensors, one write): byte for byte what the checkpoint
    writer gives for the same arrays, its metadata ordered."""
    import tempfile
    from pathlib import Path

    from witness.bundle.checkpoint import safetensors_bytes, save_safetensors

    rng = np.random.default_rng(0)
    arrays = {"chunks": rng.integers(0, 255, (3, 4, 1024), np.uint8), "paths": rng.integers(0, 255, (50, 32), np.uint8)}
    with tempfile.TemporaryDirectory() as d:
        for meta in ({"size": "10", "format": "f", "first": "0", "chunks": "1,2"}, {"a": "1"}, {"z": "é", "b": "22"}):
            save_safetensors({k: torch.from_numpy(v) for k, v in arrays.items()}, Path(d) / "x", meta)
            assert (Path(d) / "x").read_bytes() == safetensors_bytes(arrays, meta)


def test_a_ring_slot_serves_only_a_state_of_its_shapes_and_dtypes():
    """A slot whose names match but whose shapes or dtypes do not is not reused (a copy would broadcast
    or cast, and the slot's hash would not be the state's)."""
    from witness.record.kept import StatePool

    pool = StatePool(None)
    first = pool.copy({"model.x": torch.ones(4), "optim.x.step": torch.tensor(1.0)})
    pool.release(first)
    other = {"model.x": torch.full((1,), 2.0), "optim.x.step": torch.tensor(2)}
    slot = pool.copy(other)
    assert slot is not first and pool.plan(slot, "blake3").state_hash() == state_hash(other, "blake3")
