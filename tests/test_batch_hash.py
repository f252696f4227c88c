"""The batched SHA-256 of the data commitments: the native module and its Python twin give the same
bytes, RFC 6962's test vectors hold, and malformed cuts are refused by both."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_merkle import HASHES, ROOTS

from witness.commit import batch
from witness.commit.hashing import leaf_hash, tagged_hash
from witness.commit.merkle import merkle_root


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Each test runs on the native module (which the set-up builds: it must be there) and on Python."""
    assert batch.NATIVE, "witness.commit._native was not built (pip install -e . builds it; it needs gcc and OpenSSL's headers)"
    if request.param == "python":
        monkeypatch.setattr(batch, "_native", None)
    return request.param


def test_rfc_6962_vectors(impl):
    for n in range(1, len(HASHES) + 1):
        assert batch.tree_root(b"".join(HASHES[:n])).hex() == ROOTS[n]
    assert batch.tree_root(b"").hex() == ROOTS[0]
    assert batch.leaf_hashes(b"\x10" * 2, 1) == leaf_hash(b"\x10") * 2


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_batches_are_the_one_at_a_time_hashes(impl, threads):
    rng = np.random.default_rng(threads)
    data = os.urandom(105 * 5000)
    assert batch.tagged_many("witness/sample/v1", data, 105, threads) == \
        b"".join(tagged_hash("witness/sample/v1", data[i:i + 105]) for i in range(0, len(data), 105))
    cuts = np.sort(rng.integers(0, len(data), 300)).astype("<u8")
    cuts[0], cuts[-1] = 0, len(data)
    want = b"".join(tagged_hash("t", data[cuts[i]:cuts[i + 1]]) for i in range(len(cuts) - 1))
    assert batch.tagged_many("t", data, cuts, threads) == want
    spans = cuts.reshape(-1, 2).ravel()  # disjoint spans with gaps between them
    assert batch.tagged_many("t", data, spans, threads, spans=True) == \
        b"".join(tagged_hash("t", data[spans[2 * i]:spans[2 * i + 1]]) for i in range(len(spans) // 2))
    records = os.urandom(64 * 3001)
    assert batch.leaf_hashes(records, 64, threads) == b"".join(leaf_hash(records[i:i + 64]) for i in range(0, len(records), 64))
    for n in (1, 2, 3, 4097, 5000):
        leaves = os.urandom(32 * n)
        assert batch.tree_root(leaves, threads) == merkle_root([leaves[i:i + 32] for i in range(0, 32 * n, 32)])


@pytest.mark.parametrize("token", [2, 4])
def test_packed_windows_hash_as_their_assembled_bytes(impl, token):
    tokens = os.urandom(token * 1001)
    keys = os.urandom(32 * 100)
    block = 10
    got = batch.tagged_windows("witness/sample/v1", keys, tokens, 7 * block, block, token, (block + 1) * token)
    hashes = [tagged_hash("witness/sample/v1", keys[32 * i:32 * i + 32] + (7 * block + i * block).to_bytes(8, "big")
                          + tokens[i * block * token:(i * block + block + 1) * token]) for i in range(100)]
    assert got == b"".join(h + leaf_hash(h + keys[32 * i:32 * i + 32]) for i, h in enumerate(hashes))
    with pytest.raises(ValueError):  # the last window would run past the tokens
        batch.tagged_windows("t", keys + os.urandom(32), tokens, 0, block, token, (block + 1) * token)


def test_a_root_streamed_in_chunks_is_the_whole_tree_root(impl):
    for n, chunk in ((1, 4), (16, 4), (17, 4), (1000, 64), (4096, 1024), (4097, 1024)):
        leaves = os.urandom(32 * n)
        acc = batch.StreamingRoot()
        for lo in range(0, n, chunk):
            acc.add(leaves[32 * lo:32 * min(n, lo + chunk)])
        assert acc.root() == merkle_root([leaves[i:i + 32] for i in range(0, 32 * n, 32)]) and acc.size == n
    acc = batch.StreamingRoot()
    acc.add(os.urandom(32 * 3))
    with pytest.raises(ValueError, match="must be the last"):
        acc.add(os.urandom(32))
    acc = batch.StreamingRoot()
    acc.add(os.urandom(32 * 2))
    with pytest.raises(ValueError, match="more leaves than the one before"):
        acc.add(os.urandom(32 * 4))


def test_malformed_cuts_are_refused(impl):
    data = bytes(100)
    for cut, spans in ((7, False), (np.array([0, 50, 40], "<u8"), False), (np.array([0, 101], "<u8"), False),
                       (np.array([10, 5], "<u8"), True), (np.array([0, 200], "<u8"), True)):
        with pytest.raises(ValueError):
            batch.tagged_many("t", data, cut, spans=spans)
    with pytest.raises(ValueError):
        batch.leaf_hashes(bytes(65), 64)
    with pytest.raises(ValueError):
        batch.tree_root(bytes(33))
