"""Sorted-tree membership and absence proofs: properties, edges and tampering."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from witness.commit.merkle import EMPTY_ROOT
from witness.commit.sorted_tree import (
    Absence,
    Membership,
    SortedTree,
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
            verify_member(tree.prove_member(v), tree.root, tree.size)
            with pytest.raises(ValueError):
                tree.prove_absent(v)
        else:
            verify_absent(v, tree.prove_absent(v), tree.root, tree.size)
            with pytest.raises(ValueError):
                tree.prove_member(v)


@settings(max_examples=100, deadline=None)
@given(st.lists(hashes, min_size=1, max_size=40, unique=True), st.data())
def test_an_absence_proof_never_covers_a_member(values, data):
    tree = SortedTree(values)
    query = data.draw(hashes)
    if query in tree:
        return
    proof = tree.prove_absent(query)
    for member in values:
        with pytest.raises(VerificationError):
            verify_absent(member, proof, tree.root, tree.size)


def test_empty_tree():
    tree = SortedTree([])
    assert tree.root == EMPTY_ROOT
    proof = tree.prove_absent(h(1))
    verify_absent(h(1), proof, EMPTY_ROOT, 0)
    with pytest.raises(VerificationError):
        verify_absent(h(1), proof, SortedTree([h(2)]).root, 0)


def test_one_leaf_first_last_and_duplicates():
    one = SortedTree([h(5), h(5), h(5)])
    assert one.size == 1
    verify_member(one.prove_member(h(5)), one.root, one.size)
    for q in (b"\x00" * 32, b"\xff" * 32):
        verify_absent(q, one.prove_absent(q), one.root, one.size)
    many = SortedTree([h(i) for i in range(10)] * 2)
    assert many.size == 10
    first, last = many.values[0], many.values[-1]
    verify_member(many.prove_member(first), many.root, many.size)
    verify_member(many.prove_member(last), many.root, many.size)
    below, above = b"\x00" * 32, b"\xff" * 32
    pb, pa = many.prove_absent(below), many.prove_absent(above)
    assert (pb.lo, len(pb.neighbours)) == (0, 1) and (pa.lo, len(pa.neighbours)) == (9, 1)
    verify_absent(below, pb, many.root, many.size)
    verify_absent(above, pa, many.root, many.size)
    with pytest.raises(VerificationError):  # the first leaf cannot vouch for a value above it
        verify_absent(above, Absence(0, [first], 10, pb.path), many.root, many.size)


def _middle(tree):
    v = tree.values
    q = (int.from_bytes(v[3], "big") + 1).to_bytes(32, "big")
    assert v[3] < q < v[4]
    return q


def test_tampered_absence_proofs_are_rejected():
    tree = SortedTree([h(i) for i in range(37)])
    q = _middle(tree)
    good = tree.prove_absent(q)
    verify_absent(q, good, tree.root, tree.size)
    bad_sibling = [bytes([good.path[0][0] ^ 1]) + good.path[0][1:]] + good.path[1:]
    cases = {
        "changed sibling": Absence(good.lo, good.neighbours, good.size, bad_sibling),
        "changed index": Absence(good.lo + 1, good.neighbours, good.size, good.path),
        "not adjacent": Absence(2, [tree.values[2], tree.values[4]], 37,
                                tree.prove_absent(q).path),
        "wrong size": Absence(good.lo, good.neighbours, 38, good.path),  # not the committed size
        "short path": Absence(good.lo, good.neighbours, good.size, good.path[:-1]),
        "long path": Absence(good.lo, good.neighbours, good.size, good.path + [h(0)]),
        "swapped": Absence(good.lo, good.neighbours[::-1], good.size, good.path),
    }
    for name, proof in cases.items():
        with pytest.raises(VerificationError):
            verify_absent(q, proof, tree.root, tree.size)
        assert name
    with pytest.raises(VerificationError):
        verify_absent(q, good, SortedTree([h(i) for i in range(36)]).root, 37)


def test_non_adjacent_pair_with_honest_paths_is_rejected():
    from witness.commit.sorted_tree import range_proof

    tree = SortedTree([h(i) for i in range(16)])
    q = _middle(tree)
    # Leaves 3 and 5 with a range proof for [3, 6): skipping leaf 4 cannot reach the root.
    path = range_proof(tree.tree, 3, 6)
    with pytest.raises(VerificationError):
        verify_absent(q, Absence(3, [tree.values[3], tree.values[5]], 16, path), tree.root, tree.size)


def test_tampered_membership_is_rejected():
    tree = SortedTree([h(i) for i in range(20)])
    m = tree.prove_member(tree.values[7])
    verify_member(m, tree.root, tree.size)
    for bad in (
        Membership(m.value, m.index + 1, m.size, m.path),
        Membership(h(99), m.index, m.size, m.path),
        Membership(m.value, m.index, m.size, [m.path[0][::-1]] + m.path[1:]),
    ):
        with pytest.raises(VerificationError):
            verify_member(bad, tree.root, tree.size)
    with pytest.raises(VerificationError):
        verify_member(m, SortedTree([h(i) for i in range(21)]).root, 20)
