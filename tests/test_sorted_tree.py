"""Sorted-tree membership and absence proofs: properties, edges and tampering."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from witness.commit.merkle import MerkleTree
from witness.commit.sorted_tree import (
    PairProof,
    SortedTree,
    pair_leaf,
    verify_absent,
    verify_member,
)
from witness.errors import VerificationError

hashes = st.binary(min_size=32, max_size=32)


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


@settings(max_examples=200, deadline=None)
@given(st.lists(hashes, max_size=60), hashes)
def test_proof_exists_iff_membership(values, query):
    tree = SortedTree(values)
    for v in values[:5] + [query]:
        if v in set(values):
            verify_member(v, tree.prove_member(v), tree.root, tree.size)
            with pytest.raises(ValueError):
                tree.prove_absent(v)
        else:
            verify_absent(v, tree.prove_absent(v), tree.root, tree.size)
            with pytest.raises(ValueError):
                tree.prove_member(v)


@settings(max_examples=100, deadline=None)
@given(st.lists(hashes, min_size=1, max_size=40, unique=True), hashes)
def test_no_proof_ever_says_both(values, query):
    tree = SortedTree(values)
    if query in tree:
        return
    absent = tree.prove_absent(query)
    for member in values:  # an absence proof covers no member, and vouches for no membership
        with pytest.raises(VerificationError):
            verify_absent(member, absent, tree.root, tree.size)
    with pytest.raises(VerificationError):
        verify_member(query, absent, tree.root, tree.size)


def test_empty_tree():
    tree = SortedTree([])
    proof = tree.prove_absent(h(1))
    assert (proof.lower, proof.upper, proof.path) == (None, None, [])
    verify_absent(h(1), proof, tree.root, 0)
    with pytest.raises(VerificationError):
        verify_absent(h(1), proof, SortedTree([h(2)]).root, 0)


def test_one_leaf_first_last_and_duplicates():
    one = SortedTree([h(5), h(5), h(5)])
    assert one.size == 1
    verify_member(h(5), one.prove_member(h(5)), one.root, 1)
    for q in (b"\x00" * 32, b"\xff" * 32):
        verify_absent(q, one.prove_absent(q), one.root, 1)
    many = SortedTree([h(i) for i in range(10)] * 2)
    assert many.size == 10
    first, last = many.values[0], many.values[-1]
    verify_member(first, many.prove_member(first), many.root, 10)
    verify_member(last, many.prove_member(last), many.root, 10)
    below, above = b"\x00" * 32, b"\xff" * 32
    pb, pa = many.prove_absent(below), many.prove_absent(above)
    assert (pb.index, pb.lower) == (0, None) and (pa.index, pa.upper) == (10, None)
    verify_absent(below, pb, many.root, 10)
    verify_absent(above, pa, many.root, 10)
    with pytest.raises(VerificationError):  # the first leaf cannot vouch for a value above it
        verify_absent(above, pb, many.root, 10)


def _middle(tree):
    v = tree.values
    q = (int.from_bytes(v[3], "big") + 1).to_bytes(32, "big")
    assert v[3] < q < v[4]
    return q


def _flip(b: bytes) -> bytes:
    return bytes([b[0] ^ 1]) + b[1:]


def test_tampered_absence_proofs_are_rejected():
    tree = SortedTree([h(i) for i in range(37)])
    q = _middle(tree)
    g = tree.prove_absent(q)
    verify_absent(q, g, tree.root, 37)
    cases = {
        "changed sibling": PairProof(g.index, g.lower, g.upper, g.size, [_flip(g.path[0])] + g.path[1:]),
        "changed index": PairProof(g.index + 1, g.lower, g.upper, g.size, g.path),
        "changed neighbour": PairProof(g.index, g.lower, _flip(g.upper), g.size, g.path),
        "not adjacent": PairProof(g.index, g.lower, tree.values[5], g.size, g.path),
        "wrong size": PairProof(g.index, g.lower, g.upper, 38, g.path),
        "short path": PairProof(g.index, g.lower, g.upper, g.size, g.path[:-1]),
        "long path": PairProof(g.index, g.lower, g.upper, g.size, g.path + [h(0)]),
        "swapped": PairProof(g.index, g.upper, g.lower, g.size, g.path),
        "dropped lower": PairProof(g.index, None, g.upper, g.size, g.path),
    }
    for name, proof in cases.items():
        with pytest.raises(VerificationError):
            verify_absent(q, proof, tree.root, 37)
        assert name
    with pytest.raises(VerificationError):  # against the wrong root
        verify_absent(q, g, SortedTree([h(i) for i in range(36)]).root, 37)


def test_a_forged_pair_that_skips_a_member_is_not_in_the_tree():
    tree = SortedTree([h(i) for i in range(16)])
    q = _middle(tree)
    # A liar pairs v3 with v5, hiding v4, and builds a path from a tree that has such a leaf.
    forged_leaves = list(tree.tree.levels[0])
    forged_leaves[4] = pair_leaf(tree.values[3], tree.values[5])
    path = MerkleTree(forged_leaves).inclusion_proof(4)
    with pytest.raises(VerificationError):
        verify_absent(tree.values[4], PairProof(4, tree.values[3], tree.values[5], 16, path), tree.root, 16)
    verify_absent(q, tree.prove_absent(q), tree.root, 16)


def test_tampered_membership_is_rejected():
    tree = SortedTree([h(i) for i in range(20)])
    v = tree.values[7]
    m = tree.prove_member(v)
    verify_member(v, m, tree.root, 20)
    for bad in (
        PairProof(m.index + 1, m.lower, m.upper, 20, m.path),
        PairProof(m.index, m.lower, m.upper, 20, [m.path[0][::-1]] + m.path[1:]),
    ):
        with pytest.raises(VerificationError):
            verify_member(v, bad, tree.root, 20)
    with pytest.raises(VerificationError):
        verify_member(h(99), m, tree.root, 20)
    with pytest.raises(VerificationError):
        verify_member(v, m, SortedTree([h(i) for i in range(21)]).root, 20)
