"""RFC 6962 / RFC 9162 test vectors and attacks on the Merkle proofs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from witness.commit.hashing import leaf_hash, sha256
from witness.commit.merkle import (
    EMPTY_ROOT,
    MerkleTree,
    merkle_root,
    verify_consistency,
    verify_inclusion,
)
from witness.errors import VerificationError

LEAVES = [
    bytes.fromhex(h)
    for h in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
              "606162636465666768696a6b6c6d6e6f"]
]
ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
INCLUSION = {
    (0, 8): ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
             "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
             "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"],
    (5, 8): ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
             "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
             "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"],
}
CONSISTENCY = {
    (2, 8): ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
             "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"],
    (6, 8): ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
             "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
             "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"],
    (2, 5): ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
             "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"],
}
HASHES = [leaf_hash(x) for x in LEAVES]


def test_empty_root_is_sha256_of_nothing():
    assert EMPTY_ROOT == sha256(b"") == bytes.fromhex(ROOTS[0])
    assert MerkleTree().root() == EMPTY_ROOT


def test_rfc6962_roots_for_every_size():
    tree = MerkleTree(HASHES)
    for n in range(9):
        assert tree.root(n).hex() == ROOTS[n]
        assert merkle_root(HASHES[:n]).hex() == ROOTS[n]


def test_append_matches_bulk_build():
    tree = MerkleTree()
    for i, h in enumerate(HASHES):
        tree.append(h)
        assert tree.root().hex() == ROOTS[i + 1]


@pytest.mark.parametrize("index,size", sorted(INCLUSION))
def test_rfc6962_inclusion_vectors(index, size):
    tree = MerkleTree(HASHES)
    proof = tree.inclusion_proof(index, size)
    assert [p.hex() for p in proof] == INCLUSION[(index, size)]
    verify_inclusion(HASHES[index], index, size, proof, bytes.fromhex(ROOTS[size]))


@pytest.mark.parametrize("first,second", sorted(CONSISTENCY))
def test_rfc6962_consistency_vectors(first, second):
    tree = MerkleTree(HASHES)
    proof = tree.consistency_proof(first, second)
    assert [p.hex() for p in proof] == CONSISTENCY[(first, second)]
    verify_consistency(first, second, bytes.fromhex(ROOTS[first]), bytes.fromhex(ROOTS[second]), proof)


def _many(n):
    return [leaf_hash(i.to_bytes(4, "big")) for i in range(n)]


def test_every_proof_verifies_and_every_mutation_fails():
    leaves = _many(21)
    tree = MerkleTree(leaves)
    for n in range(1, 22):
        root = tree.root(n)
        for i in range(n):
            proof = tree.inclusion_proof(i, n)
            verify_inclusion(leaves[i], i, n, proof, root)
            if n > 1:
                with pytest.raises(VerificationError):
                    verify_inclusion(leaves[i], (i + 1) % n, n, proof, root)
                with pytest.raises(VerificationError):
                    verify_inclusion(leaves[(i + 1) % n], i, n, proof, root)
            for j in range(len(proof)):
                bad = list(proof)
                bad[j] = bytes([bad[j][0] ^ 1]) + bad[j][1:]
                with pytest.raises(VerificationError):
                    verify_inclusion(leaves[i], i, n, bad, root)
            with pytest.raises(VerificationError):
                verify_inclusion(leaves[i], i, n, proof + [leaves[0]], root)
        for m in range(0, n + 1):
            proof = tree.consistency_proof(m, n)
            verify_consistency(m, n, tree.root(m), root, proof)
            if 0 < m < n:
                with pytest.raises(VerificationError):
                    verify_consistency(m, n, tree.root(m), tree.root(n - 1) if n - 1 != m else leaves[0], proof)
                for j in range(len(proof)):
                    bad = list(proof)
                    bad[j] = bytes([bad[j][0] ^ 1]) + bad[j][1:]
                    with pytest.raises(VerificationError):
                        verify_consistency(m, n, tree.root(m), root, bad)
                with pytest.raises(VerificationError):
                    verify_consistency(m, n, tree.root(m), root, proof[:-1])


def test_shrinking_or_short_hashes_are_rejected():
    tree = MerkleTree(HASHES)
    with pytest.raises(VerificationError):
        verify_consistency(8, 6, tree.root(8), tree.root(6), [])
    with pytest.raises(VerificationError):
        verify_inclusion(HASHES[0], 0, 8, [b"\x00" * 31], tree.root())
    with pytest.raises(VerificationError):
        verify_inclusion(HASHES[0], 8, 8, tree.inclusion_proof(0), tree.root())


@given(st.integers(1, 300), st.data())
def test_incremental_tree_equals_rebuilt_tree(n, data):
    leaves = _many(n)
    inc = MerkleTree()
    for h in leaves:
        inc.append(h)
    assert inc.root() == MerkleTree(leaves).root() == merkle_root(leaves)
    i = data.draw(st.integers(0, n - 1))
    verify_inclusion(leaves[i], i, n, inc.inclusion_proof(i), inc.root())
