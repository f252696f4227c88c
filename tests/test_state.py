"""The training-state hash: its digests, what it covers, and tolerance mode's whole-state distances."""

from __future__ import annotations

import hashlib

import pytest
import torch

from witness.bundle.state import (
    default_digest,
    parse_digest,
    root_from_shards,
    shard_digests,
    shard_rows,
    state_distances,
    state_hash,
    tensor_digest,
    tensor_leaf,
)
from witness.commit.hashing import canonical_json, leaf_hash
from witness.commit.merkle import merkle_root
from witness.errors import MalformedInput

# BLAKE3's published vector for the empty input (the reference implementation's test_vectors.json)
BLAKE3_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
SHA256_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

TENSORS = [torch.randn(3, 4), torch.tensor(5.0), torch.zeros(0, 3), torch.randn(4, 3).t(),
           torch.randn(5, dtype=torch.bfloat16), torch.tensor([True, False]), torch.arange(5),
           torch.randn(3, requires_grad=True), torch.randn(4100, 1024)]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_digests_are_those_of_the_raw_bytes():
    import blake3

    assert tensor_digest(torch.zeros(0), "blake3") == BLAKE3_EMPTY
    assert tensor_digest(torch.zeros(0), "sha256") == SHA256_EMPTY
    for t in TENSORS:  # every dtype, layout and size (the last, over 16 MiB, on BLAKE3's threads)
        assert tensor_digest(t, "sha256") == hashlib.sha256(_bytes(t)).hexdigest()
        assert tensor_digest(t, "blake3") == blake3.blake3(_bytes(t)).hexdigest()
    assert default_digest() == "blake3"


def test_the_state_hash_is_the_merkle_root_of_named_leaves():
    state = {"model.w": torch.randn(2, 3), "optim.w.step": torch.tensor(3.0), "model.b": torch.zeros(3)}
    for d in ("blake3", "sha256"):
        leaves = [leaf_hash(canonical_json({"name": n, "dtype": str(state[n].dtype).removeprefix("torch."),
                                            "shape": list(state[n].shape), d: tensor_digest(state[n], d)}))
                  for n in sorted(state)]
        assert state_hash(state, d) == merkle_root(leaves)
        assert tensor_leaf("model.w", state["model.w"], d) == leaves[1]
    assert state_hash(state, "blake3") != state_hash(state, "sha256")


def test_the_state_hash_does_not_depend_on_the_thread_count():
    # over a mebibyte in all, the tensors are shared out among torch's threads; the root must be
    # the one tensor-by-tensor hashing gives, with every leaf in name order
    state = {f"model.l{i}.w": torch.randn(64 * (i + 1), 64) for i in range(12)}
    state |= {f"optim.l{i}.w.step": torch.tensor(float(i)) for i in range(12)}
    before = torch.get_num_threads()
    try:
        for d in ("blake3", "sha256"):
            want = merkle_root([tensor_leaf(n, state[n], d) for n in sorted(state)])
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert state_hash(state, d) == want
        # and on several threads, one changed coordinate anywhere changes the root
        torch.set_num_threads(2)
        base = state_hash(state, "blake3")
        for name in state:
            changed = dict(state)
            changed[name] = state[name].clone()
            changed[name].view(-1)[-1] += 1
            assert state_hash(changed, "blake3") != base, name
    finally:
        torch.set_num_threads(before)


def test_every_part_of_every_tensor_is_covered():
    state = {"model.w": torch.randn(4, 4), "model.running_mean": torch.randn(4), "optim.w.exp_avg": torch.randn(4, 4),
             "optim.w.step": torch.tensor(7.0)}
    base = state_hash(state, "blake3")
    for name in state:
        changed = dict(state)
        t = state[name].clone()
        t.view(-1)[-1] = torch.nextafter(t.view(-1)[-1], torch.tensor(float("inf")))  # one ulp
        changed[name] = t
        assert state_hash(changed, "blake3") != base, name
    assert state_hash({**state, "model.w": state["model.w"].double()}, "blake3") != base  # dtype
    assert state_hash({**state, "model.w": state["model.w"].reshape(2, 8)}, "blake3") != base  # shape
    renamed = {("model.v" if k == "model.w" else k): v for k, v in state.items()}
    assert state_hash(renamed, "blake3") != base
    assert state_hash(dict(reversed(list(state.items()))), "blake3") == base  # order of the dict: none


def test_whole_state_distances():
    a = {"model.w": torch.ones(10), "model.bn.running_var": torch.ones(2), "model.bn.num_batches_tracked": torch.tensor(3),
         "optim.w.exp_avg": torch.ones(10), "optim.w.exp_avg_sq": torch.ones(10), "optim.w.step": torch.tensor(3.0)}
    b = {k: v.clone() for k, v in a.items()}
    b["model.w"][0] += 1.0  # ||diff|| / ||w|| = 1 / sqrt(10)
    d = state_distances(b, a, parameters={"model.w"})
    assert d["parameters"] == pytest.approx(10 ** -0.5)
    assert d["buffers"] == d["optimizer.exp_avg"] == d["optimizer.exp_avg_sq"] == 0.0
    for k, v in (("optim.w.step", torch.tensor(4.0)), ("model.bn.num_batches_tracked", torch.tensor(4))):
        with pytest.raises(ValueError, match=k.replace(".", r"\.")):
            state_distances({**a, k: v}, a, parameters={"model.w"})
    with pytest.raises(ValueError, match="different tensors"):
        state_distances({**a, "optim.w.extra": torch.ones(1)}, a, parameters={"model.w"})
    with pytest.raises(ValueError, match="shape or dtype"):
        state_distances({**a, "model.w": torch.ones(11)}, a, parameters={"model.w"})


def test_the_same_state_is_written_as_the_same_file(tmp_path):
    # safetensors orders metadata by a hash map seeded afresh for each map: without the rewrite,
    # ten writes of one state give several different files (and a release two SHA-256s)
    from safetensors import safe_open

    from witness.bundle.checkpoint import read_checkpoint, save_checkpoint, save_safetensors

    state = {"model.w": torch.randn(3, 4), "optim.w.step": torch.tensor(2.0)}
    files = set()
    for i in range(10):
        save_checkpoint(tmp_path / f"{i}.safetensors", state, 7, "blake3")
        files.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(files) == 1
    got = read_checkpoint(tmp_path / "0.safetensors")
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    meta = {"zeta": "1", "alpha": "two", "mid": "x" * 40}
    releases = set()
    for i in range(10):
        save_safetensors({"w": state["model.w"]}, tmp_path / f"r{i}", meta)
        releases.add((tmp_path / f"r{i}").read_bytes())
    assert len(releases) == 1
    raw = releases.pop()
    assert raw[8:].startswith(b'{"__metadata__":{"alpha":"two","mid":"' + b"x" * 40 + b'","zeta":"1"}')
    with safe_open(str(tmp_path / "r0"), "pt") as f:
        assert f.metadata() == meta


SHARDED_STATE = {"model.w": torch.randn(11, 3), "model.b": torch.randn(2), "model.e": torch.zeros(0, 4),
                 "optim.w.exp_avg": torch.randn(11, 3), "optim.w.step": torch.tensor(7.0),
                 "model.h": torch.randn(5, dtype=torch.bfloat16)}


def _shard_roots(state: dict[str, torch.Tensor], digest: str, ranks: int) -> bytes:
    """What an FSDP2 run's ranks compute: each hashes its rows, rank 0 composes."""
    pieces = [{n: (t if t.dim() == 0 else t[a:b]) for n, t in state.items()
               for a, b in [shard_rows(t.shape[0], ranks)[r] if t.dim() else (0, 0)]} for r in range(ranks)]
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    return root_from_shards(layout, [shard_digests(p, digest) for p in pieces], digest)


@pytest.mark.parametrize("name", ["sha256", "blake3"])
@pytest.mark.parametrize("ranks", [2, 3, 8])  # 8 ranks: 2 rows leave most shards empty
def test_a_sharded_state_root_is_the_one_of_the_whole_tensors(name, ranks):
    digest = f"{name}/{ranks}"
    root = _shard_roots(SHARDED_STATE, digest, ranks)
    assert root == state_hash(SHARDED_STATE, digest) != state_hash(SHARDED_STATE, name)
    # the digest of a sharded tensor is the hash of its shards' digests, in rank order
    w = SHARDED_STATE["model.w"]
    parts = [tensor_digest(w[a:b], name) for a, b in shard_rows(11, ranks)]
    assert tensor_digest(w, digest) == tensor_digest(torch.frombuffer(bytearray(b"".join(
        bytes.fromhex(p) for p in parts)), dtype=torch.uint8), name)
    assert tensor_digest(SHARDED_STATE["optim.w.step"], digest) == tensor_digest(SHARDED_STATE["optim.w.step"], name)


def test_a_sharded_root_binds_every_row_and_the_rank_order():
    digest = "blake3/3"
    root = state_hash(SHARDED_STATE, digest)
    for name, t in SHARDED_STATE.items():
        for i in range(t.numel()):  # any coordinate of any shard
            changed = dict(SHARDED_STATE, **{name: t.clone()})
            changed[name].view(-1)[i] += 1
            assert _shard_roots(changed, digest, 3) != root, (name, i)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in SHARDED_STATE.items()}
    ranks = [shard_digests({n: t[a:b] if t.dim() else t for n, t in SHARDED_STATE.items()
                            for a, b in [shard_rows(t.shape[0], 3)[r] if t.dim() else (0, 0)]}, digest)
             for r in range(3)]
    assert root_from_shards(layout, ranks, digest) == root
    assert root_from_shards(layout, [ranks[1], ranks[0], ranks[2]], digest) != root  # shards out of order
    with pytest.raises(ValueError, match="every rank"):
        root_from_shards(layout, ranks[:2], digest)
    # row splits are FSDP2's: chunks of ceil(rows / ranks), the last ones short or empty
    assert shard_rows(11, 3) == [(0, 4), (4, 8), (8, 11)] and shard_rows(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("spec", ["blake3/1", "blake3/01", "blake3/x", "blake3/", "md5/2", "blake3/2000",
                                  "blake3/2/2", 7, "sha256 /2"])
def test_a_malformed_state_digest_is_refused(spec):
    with pytest.raises(MalformedInput, match="state digest"):
        parse_digest(spec)


def test_a_manifest_names_row_shards_only_for_its_own_fsdp_ranks(honest_bundle, signing_key, tmp_path):
    import shutil

    from helpers import edit_manifest

    from witness.bundle.reader import open_bundle

    bundle = tmp_path / "b"
    shutil.copytree(honest_bundle, bundle)
    for fields in ({"state_digest": "blake3/2"},  # one process
                   {"state_digest": "blake3/2", "parallelism": "fsdp", "world_size": 4},
                   {"state_digest": "sha256/4", "parallelism": "ddp", "world_size": 2},
                   {"state_digest": "blake3/9999"}):
        edit_manifest(bundle, signing_key, **fields)
        with pytest.raises(MalformedInput, match="state_digest"):
            open_bundle(bundle)
