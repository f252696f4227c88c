"""The training-state hash: its digests, what it covers, and tolerance mode's whole-state distances."""

from __future__ import annotations

import hashlib

import pytest
import torch

from witness.bundle.state import (
    default_digest,
    state_distances,
    state_hash,
    tensor_digest,
    tensor_leaf,
)
from witness.commit.hashing import canonical_json, leaf_hash
from witness.commit.merkle import merkle_root

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
