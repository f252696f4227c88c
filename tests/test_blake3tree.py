"""BLAKE3 with its chaining values (``witness.commit.blake3tree``, native and numpy twin): digests
equal the ``blake3`` package's and BLAKE3's published vectors, and a chunk's path leads to the digest
only from the right chunk, position and flags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import numpy as np
import pytest

import witness.commit.blake3tree as bt
from witness.commit.chunks import path_nodes

SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 2049, 3 * 1024 + 7, 16 * 1024, 16 * 1024 + 1, 17 * 1024 - 1,
         33 * 1024 + 5, 100_000]
VECTORS = json.loads((Path(__file__).parent / "data" / "blake3_vectors.json").read_text())


@pytest.fixture(params=["native", "numpy"])
def impl(request, monkeypatch):
    """Both implementations: the native module and the numpy twin give the same bytes."""
    if request.param == "numpy":
        monkeypatch.setattr(bt, "_blake3", None)
    else:
        assert bt.NATIVE, "the native BLAKE3 module is built by make setup"
    return request.param


def _openings(data: bytes, tree: bt.TensorTree, indices: list[int]):
    raw = np.frombuffer(data, np.uint8)
    rows = np.zeros((len(indices), 1024), np.uint8)
    lengths = np.zeros(len(indices), np.int64)
    for r, i in enumerate(indices):
        c = raw[i * 1024:(i + 1) * 1024]
        rows[r, :c.size], lengths[r] = c, c.size
    paths = [tree.path(i, data) for i in indices]
    nodes = np.concatenate(paths) if any(len(p) for p in paths) else np.zeros((0, 32), np.uint8)
    starts = np.cumsum([0] + [len(p) for p in paths])[:-1]
    return rows, lengths, np.array(indices), nodes, starts


def test_published_vectors(impl):
    for length, want in VECTORS["cases"]:
        data = bytes(i % 251 for i in range(length))
        assert bt.digest(data).hex() == want, length


@pytest.mark.parametrize("size", SIZES)
def test_digest_and_levels_match_the_package(impl, size):
    data = os.urandom(size)
    root, kept = bt.tree(data)
    assert root == blake3.blake3(data).digest()
    n = bt.chunk_count(size)
    levels = np.frombuffer(kept, np.uint8).reshape(-1, 32)
    cvs = np.frombuffer(bt.chunk_cvs(data), np.uint8).reshape(-1, 32)
    assert len(cvs) == (n if size else 0)
    if n > 1:
        assert np.array_equal(levels[:n], cvs)  # level 0: the chunks' CVs
        assert len(levels) == sum(_sizes(n)[:-1])
        top = levels[-2:].reshape(-1)
        assert bt.parents(top, np.ones(1, np.uint8)) == root  # the root is the top pair with ROOT
        assert bt.parents(top) != root  # ... and without it, a CV that is not the digest


def _sizes(n):
    out = [n]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


def test_every_dtype_and_a_counter(impl):
    import torch

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.int32):
        t = (torch.randn(777, 3) * 100).to(dtype)
        raw = t.reshape(-1).view(torch.uint8).numpy()
        assert bt.digest(raw) == blake3.blake3(raw.tobytes()).digest()
    data = os.urandom(5 * 1024)
    # a chunk's CV depends on its index: chunks 2.. hashed on their own with counter 2 are the same CVs
    assert bt.chunk_cvs(data[2048:], 2) == bt.chunk_cvs(data)[64:]
    assert bt.chunk_cvs(data[2048:], 0) != bt.chunk_cvs(data)[64:]


def test_the_two_implementations_agree(monkeypatch):
    data = os.urandom(40 * 1024 + 3)
    native = bt.tree(data, 0, 2), bt.chunk_cvs(data, 7)
    monkeypatch.setattr(bt, "_blake3", None)
    assert (bt.tree(data, 0), bt.chunk_cvs(data, 7)) == native


@pytest.mark.parametrize("size", [1, 1024, 1025, 3 * 1024 + 7, 17 * 1024 - 1, 40 * 1024 + 3])
def test_honest_paths_lead_to_the_digest(impl, size):
    data = os.urandom(size)
    tree = bt.TensorTree(data, keep_from=2)
    indices = list(range(tree.size))
    rows, lengths, index, nodes, starts = _openings(data, tree, indices)
    assert [len(tree.path(i, data)) for i in indices] == [len(path_nodes(i, tree.size)) for i in indices]
    tops = bt.path_roots(rows, lengths, index, np.full(len(indices), tree.size), nodes, starts)
    assert all(t.tobytes() == tree.digest for t in tops)


def test_forged_openings_do_not_lead_to_the_digest(impl):
    data = os.urandom(37 * 1024 + 100)
    other = bytearray(data)
    other[5000] ^= 1
    tree = bt.TensorTree(data)
    n = tree.size

    def top(rows, lengths, index, nodes, starts, size=n):
        return bt.path_roots(rows, lengths, index, np.full(len(index), size), nodes, starts)[0].tobytes()

    rows, lengths, index, nodes, starts = _openings(data, tree, [9])
    assert top(rows, lengths, index, nodes, starts) == tree.digest
    flipped = rows.copy()
    flipped[0, 3] ^= 0x10  # one bit of the chunk
    assert top(flipped, lengths, index, nodes, starts) != tree.digest
    # another position: chunk 9's bytes and path claimed as chunk 8's or 10's
    for i in (8, 10):
        assert top(rows, lengths, np.array([i]), nodes, starts) != tree.digest
    # another buffer's path (a state that differs in one bit elsewhere)
    other_tree = bt.TensorTree(bytes(other))
    _, _, _, other_nodes, _ = _openings(bytes(other), other_tree, [9])
    assert top(rows, lengths, index, other_nodes, starts) != tree.digest
    # another size: the same path read as a buffer of twice the chunks (a path says nothing of the size
    # where its shape is the same: the verifier takes each tensor's size from its own layout)
    assert top(rows, lengths, index, np.concatenate([nodes, nodes[-1:]]), starts, size=2 * n) != tree.digest
    # a shortened last chunk: its length is part of its hash
    last = _openings(data, tree, [n - 1])
    short = (last[0], last[1] - 1, *last[2:])
    assert top(*last) == tree.digest and top(*short) != tree.digest


def test_flags_tell_a_root_from_a_chaining_value(impl):
    # a one-chunk buffer's digest is its chunk with ROOT; the same chunk's CV is not
    data = os.urandom(700)
    rows = np.zeros((1, 1024), np.uint8)
    rows[0, :700] = np.frombuffer(data, np.uint8)
    args = (rows, np.array([700]), np.array([0], np.uint64))
    assert bt.chunk_outputs(*args, np.array([True]))[0].tobytes() == blake3.blake3(data).digest()
    assert bt.chunk_outputs(*args, np.array([False]))[0].tobytes() != blake3.blake3(data).digest()
    # a two-chunk buffer: the chunk's CV and its sibling's make the digest only with ROOT on the parent,
    # so a subtree's CV passed off as the digest of a shorter buffer is refused
    data = os.urandom(2048)
    cvs = bt.chunk_cvs(data)
    assert bt.parents(cvs, np.ones(1, np.uint8)) == blake3.blake3(data).digest()
    assert bt.parents(cvs) != blake3.blake3(data).digest()
    # a path one level short, ending in a CV: the opening of chunk 0 of a 4-chunk buffer stopped at its parent
    data = os.urandom(4096)
    tree = bt.TensorTree(data)
    rows, lengths, index, nodes, starts = _openings(data, tree, [0])
    top = bt.path_roots(rows, lengths, index, np.array([2]), nodes[:1], starts)[0].tobytes()
    assert top != tree.digest
    left = bt.parents(bt.chunk_cvs(data)[:64])
    assert bt.parents(left + bytes(nodes[1]), np.ones(1, np.uint8)) == tree.digest
    assert left != tree.digest


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        bt.parents(b"x" * 63)
    with pytest.raises(ValueError):
        bt.chunk_outputs(np.zeros((1, 1024), np.uint8), np.array([1025]), np.zeros(1, np.uint64), np.zeros(1, bool))
    with pytest.raises(ValueError):
        bt.chunk_outputs(np.zeros((2, 1024), np.uint8), np.array([1]), np.zeros(1, np.uint64), np.zeros(1, bool))


def test_many_digests_in_one_call_are_each_buffers(impl):
    bufs = [os.urandom(n) for n in (0, 1, 1024, 1025, 5000, 70_000)] + [np.zeros(0, np.uint8)]
    assert bt.digests(bufs) == [blake3.blake3(bytes(b)).digest() for b in bufs]
    assert bt.digests([]) == []
    with pytest.raises(TypeError):
        bt.digests([1, 2])


def test_many_trees_in_one_call_are_each_buffers_own(impl):
    """``trees`` is ``tree`` of each buffer with its own ``keep_from``: a state's small tensors hashed in one
    call, the opened ones with their upper levels kept, the others with none."""
    bufs = [os.urandom(n) for n in SIZES] + [np.zeros(0, np.uint8)]
    keeps = [(0, 4, 64)[i % 3] for i in range(len(bufs))]
    assert bt.trees(bufs, keeps) == [bt.tree(b, k) for b, k in zip(bufs, keeps, strict=True)]
    assert all(d == blake3.blake3(bytes(b)).digest() for (d, _), b in zip(bt.trees(bufs, keeps), bufs, strict=True))
    assert bt.trees([], []) == []
    if impl == "native":  # (the twin is tree() itself)
        with pytest.raises(ValueError):
            bt.trees(bufs, keeps[:-1])
        with pytest.raises(ValueError):
            bt.trees([b"x"], [-1])
        with pytest.raises(TypeError):
            bt.trees([1], [0])
        with pytest.raises(TypeError):
            bt.trees([b"x"], ["a"])


def test_bytes_past_a_rows_length_are_hashed_as_zeros_by_both(impl):
    """A chunk row's bytes past its length are not BLAKE3's input: both implementations hash them as zeros
    (the verifier checks the padding itself; the digest never depends on it)."""
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, (6, 1024), dtype=np.uint8)
    lengths = np.array([0, 1, 63, 64, 500, 1024])
    clean = rows.copy()
    for r, n in enumerate(lengths):
        clean[r, n:] = 0
    counters, roots = np.arange(6, dtype=np.uint64), np.array([1, 0, 1, 0, 1, 0], bool)
    assert np.array_equal(bt.chunk_outputs(rows, lengths, counters, roots), bt.chunk_outputs(clean, lengths, counters,
                                                                                             roots))
    assert bt.chunk_outputs(clean[4:5], lengths[4:5], np.zeros(1, np.uint64), np.ones(1, bool)).tobytes() \
        == blake3.blake3(clean[4, :500].tobytes()).digest()
