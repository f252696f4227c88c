"""Parameter chunks: the tree's paths are RFC 6962 audit paths (checked against the log's own Merkle
code, which is checked against RFC 6962's vectors), the batched path check finds every change, the
draw of chunks is the beta's alone, and the layout binds names, dtypes and shapes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from witness.commit import batch
from witness.commit.chunks import (
    ChunkTree,
    chunk_indices,
    chunk_leaves,
    path_nodes,
    verify_paths,
    wrap_root,
    wrap_roots,
)
from witness.commit.merkle import MerkleTree
from witness.fingerprint.chunks import ChunkLayout

LAYOUT = b"\x07" * 32


@pytest.fixture(params=["native", "python"])
def hashing(request, monkeypatch):
    """Each test runs on the native module and on its Python twin."""
    if request.param == "python":
        monkeypatch.setattr(batch, "_native", None)
    return request.param


def _leaves(n: int) -> bytes:
    return b"".join(os.urandom(32) for _ in range(n))


@pytest.mark.parametrize("size", [*range(1, 20), 31, 32, 33, 64, 65, 100])
def test_every_path_is_the_rfc6962_audit_path(size, hashing):
    leaves = _leaves(size)
    tree = ChunkTree(leaves, LAYOUT)
    log = MerkleTree([leaves[32 * i:32 * i + 32] for i in range(size)])
    assert tree.levels[-1].tobytes() == log.root() == batch.tree_root(leaves)
    assert tree.root == wrap_root(LAYOUT, size, log.root())
    for i in range(size):
        want = log.inclusion_proof(i)
        assert [bytes(x) for x in tree.paths([i])] == want
        assert len(want) == len(path_nodes(i, size))


def test_the_batched_root_wrap_is_the_single_one_and_binds_layout_and_size():
    tops = np.frombuffer(_leaves(5), dtype=np.uint8).reshape(5, 32)
    many = wrap_roots(LAYOUT, 9, tops)
    assert [bytes(r) for r in many] == [wrap_root(LAYOUT, 9, t.tobytes()) for t in tops]
    assert wrap_roots(LAYOUT, 9, tops[:0]).shape == (0, 32)
    assert not (wrap_roots(LAYOUT, 10, tops) == many).all(axis=1).any()
    assert not (wrap_roots(b"\x08" * 32, 9, tops) == many).all(axis=1).any()


def test_the_batched_check_reaches_each_root_and_any_change_misses_it(hashing):
    size, k, states = 37, 4, 5
    trees = [ChunkTree(_leaves(size), LAYOUT) for _ in range(states)]
    chunks = [0, 5, 22, 36]
    leaves = np.stack([t.levels[chunks] for t in trees]).reshape(-1, 32)
    nodes = np.concatenate([t.paths(chunks) for t in trees])
    per = sum(len(path_nodes(c, size)) for c in chunks)
    offsets = np.cumsum([0] + [len(path_nodes(c, size)) for c in chunks[:-1]])
    starts = (np.arange(states)[:, None] * per + offsets[None, :]).reshape(-1)
    idx = np.tile(chunks, states)
    tops = verify_paths(leaves, idx, size, nodes, starts)
    for s, t in enumerate(trees):
        assert all(bytes(x) == t.levels[-1].tobytes() for x in tops[s * k:(s + 1) * k])
    for where in ("leaf", "node"):
        bad_leaves, bad_nodes = leaves.copy(), nodes.copy()
        if where == "leaf":
            bad_leaves[6, 3] ^= 1
        else:
            bad_nodes[17, 0] ^= 0x80
        got = verify_paths(bad_leaves, idx, size, bad_nodes, starts)
        changed = [r for r in range(len(idx)) if bytes(got[r]) != bytes(tops[r])]
        assert len(changed) >= 1
    # a chunk opened as another (0 and 5 have paths of one length) leads elsewhere
    swapped = np.where(idx == 0, 5, np.where(idx == 5, 0, idx))
    moved = verify_paths(leaves, swapped, size, nodes, starts)
    assert ((moved != tops).any(axis=1) == ((idx == 0) | (idx == 5))).all()


def test_native_levels_and_nodes_match_python(monkeypatch):
    leaves = _leaves(1000)
    pairs = os.urandom(64 * 300)
    native = batch.tree_levels(leaves), batch.node_hashes(pairs)
    monkeypatch.setattr(batch, "_native", None)
    assert (batch.tree_levels(leaves), batch.node_hashes(pairs)) == native
    with pytest.raises(ValueError):
        batch.tree_levels(b"")


def test_the_draw_is_the_betas_alone():
    beta = os.urandom(32)
    a = chunk_indices(beta, 4, 300)
    assert a == chunk_indices(beta, 4, 300) and a == sorted(set(a)) and len(a) == 4 and max(a) < 300
    assert chunk_indices(beta, 10, 6) == list(range(6))
    # every chunk is drawn about as often as any other
    counts = np.zeros(50)
    for i in range(4000):
        for c in chunk_indices(i.to_bytes(32, "big"), 3, 50):
            counts[c] += 1
    expected = 4000 * 3 / 50
    assert ((counts - expected) ** 2 / expected).sum() < 100  # chi-square, 49 degrees of freedom (p < 1e-4)


def test_the_layout_binds_each_tensor_and_pads_with_zeros():
    params = {"model.b": torch.randn(3), "model.a": torch.randn(70, 5), "model.c": torch.tensor(2.5)}
    layout = ChunkLayout.of(params, 64)
    assert layout.names == ["model.a", "model.b", "model.c"]
    assert layout.starts == (0, 22, 23) and layout.size == 24  # 1,400 bytes = 22 chunks of 64
    flat = layout.flatten(params)
    views = layout.views(flat)
    assert all(torch.equal(views[n], params[n]) for n in params)
    assert flat[1400:22 * 64].eq(0).all() and flat[22 * 64 + 12:23 * 64].eq(0).all()
    assert layout.locate(21) == (0, 21 * 16, 350 - 21 * 16) and layout.locate(22) == (1, 0, 3)
    root = layout.root(params)
    changed = dict(params, **{"model.a": params["model.a"].clone()})
    changed["model.a"][69, 4] = torch.nextafter(changed["model.a"][69, 4], torch.tensor(9.0))  # one ulp
    assert layout.root(changed) != root
    # the same bytes under another name, dtype or shape are another layout
    for other in ({"model.b": params["model.b"], "model.a2": params["model.a"], "model.c": params["model.c"]},
                  {**params, "model.a": params["model.a"].reshape(5, 70)}):
        lay = ChunkLayout.of(other, 64)
        assert lay.id != layout.id and lay.root(other) != root
    with pytest.raises(ValueError, match="not the layout's"):
        layout.flatten({**params, "model.b": torch.randn(4)})
    with pytest.raises(ValueError, match="power of two"):
        ChunkLayout.of(params, 100)
    # the leaves are the tagged hashes of the chunks as they lie
    assert chunk_leaves(flat.numpy(), 64)[:32] == batch.tagged_many("witness/param-chunk/v1", flat.numpy()[:64], 64)
