"""The Triton BLAKE3 tree kernels (witness.fingerprint.b3gpu), run by Triton's interpreter on CPU
tensors: roots against the blake3 package and BLAKE3's published test vectors, every level
against a pure-Python reference, and (when it is built) against the C module witness.commit._blake3.
"""

import importlib
import os
import random
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined (its own library's at
# `import triton`, b3gpu's kernels at b3gpu's import) and again when it lazily imports parts of
# itself at the first launch, which asserts that both readings agree: so it is set here, before
# triton is imported, and left set for the session (it changes nothing for CPU-only code). The
# kernels call no library jit function, so they also run where triton was imported without it.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")  # a guard only: CI installs the gpu extra, so this runs
b3gpu = importlib.import_module("witness.fingerprint.b3gpu")
if isinstance(b3gpu._chunk_kernel, triton.runtime.JITFunction):  # imported earlier, compiled
    b3gpu = importlib.reload(b3gpu)

# ---- a pure-Python BLAKE3 (the reference for chunk CVs and parents, which blake3 does not expose)

IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
M32 = 0xFFFFFFFF
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8


def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & M32


def _compress(cv, block: bytes, counter: int, blen: int, flags: int) -> tuple:
    m = list(struct.unpack("<16I", block.ljust(64, b"\0")))
    v = list(cv) + list(IV[:4]) + [counter & M32, counter >> 32, blen, flags]

    def g(a, b, c, d, x, y):
        v[a] = (v[a] + v[b] + x) & M32
        v[d] = _rotr(v[d] ^ v[a], 16)
        v[c] = (v[c] + v[d]) & M32
        v[b] = _rotr(v[b] ^ v[c], 12)
        v[a] = (v[a] + v[b] + y) & M32
        v[d] = _rotr(v[d] ^ v[a], 8)
        v[c] = (v[c] + v[d]) & M32
        v[b] = _rotr(v[b] ^ v[c], 7)

    for _ in range(7):
        g(0, 4, 8, 12, m[0], m[1])
        g(1, 5, 9, 13, m[2], m[3])
        g(2, 6, 10, 14, m[4], m[5])
        g(3, 7, 11, 15, m[6], m[7])
        g(0, 5, 10, 15, m[8], m[9])
        g(1, 6, 11, 12, m[10], m[11])
        g(2, 7, 8, 13, m[12], m[13])
        g(3, 4, 9, 14, m[14], m[15])
        m = [m[i] for i in PERM]
    return tuple(v[i] ^ v[i + 8] for i in range(8))


def ref_chunk(chunk: bytes, counter: int, flags: int = 0) -> tuple:
    blocks = [chunk[i:i + 64] for i in range(0, len(chunk), 64)] or [b""]
    cv = IV
    for j, block in enumerate(blocks):
        f = (CHUNK_START if j == 0 else 0) | (CHUNK_END | flags if j == len(blocks) - 1 else 0)
        cv = _compress(cv, block, counter, len(block), f)
    return cv


def ref_cvs(data: bytes, counter: int = 0) -> list:
    chunks = [data[i:i + 1024] for i in range(0, len(data), 1024)] or [b""]
    return [ref_chunk(c, counter + i) for i, c in enumerate(chunks)]


def ref_parent(left: tuple, right: tuple, flags: int = 0) -> tuple:
    return _compress(IV, struct.pack("<16I", *left, *right), 0, 64, PARENT | flags)


def ref_parents(nodes: list) -> list:
    up = [ref_parent(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    return up + ([nodes[-1]] if len(nodes) % 2 else [])


def ref_levels(data: bytes) -> list:
    levels = [ref_cvs(data)]
    while len(levels[-1]) > 2:
        levels.append(ref_parents(levels[-1]))
    return levels


def packed(nodes: list) -> bytes:
    return b"".join(struct.pack("<8I", *n) for n in nodes)


def u8(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def pattern(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))  # the input of BLAKE3's test vectors


def test_reference_matches_blake3():
    for n in (0, 1, 64, 1025, 3 * 1024 + 7, 9 * 1024):
        data = os.urandom(n)
        levels = ref_levels(data)
        if len(levels[0]) == 1:
            root = ref_chunk(data, 0, ROOT)
        else:
            root = ref_parent(*levels[-1], ROOT)
        assert packed([root]) == blake3.blake3(data).digest()


_rng = random.Random(20240611)
_RANDOM_SIZE = _rng.randrange(20 * 1024 + 1, 40 * 1024)  # seeded: a failure reproduces
SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3 * 1024 + 7, 5 * 1024, 17 * 1024 - 1,
         _RANDOM_SIZE]


@pytest.mark.parametrize("n", SIZES)
def test_tree_matches_blake3_and_reference(n):
    data = random.Random(n).randbytes(n)
    t = u8(data)
    if n == _RANDOM_SIZE:  # a view 1 byte into its storage: not 4-byte aligned, so copied
        t = u8(b"\0" + data)[1:]
        assert t.data_ptr() % 4
    digest, levels = b3gpu.tree(t)
    assert digest == blake3.blake3(data).digest()
    chunks = max(1, -(-n // 1024))
    if chunks == 1:
        assert levels == []
        return
    ref = ref_levels(data)
    assert [tuple(level.shape) for level in levels] == [(len(r), 8) for r in ref]
    assert len(levels[-1]) == 2
    for level, r in zip(levels, ref, strict=True):
        assert level.dtype == torch.int32 and level.device == t.device
        assert b3gpu.cv_bytes(level) == packed(r)


def test_tree_over_several_programs():
    # more chunks than one program's lanes (128): program ids past 0 in both kernels
    data = random.Random(7).randbytes(129 * 1024 + 5)
    digest, levels = b3gpu.tree(u8(data))
    assert digest == blake3.blake3(data).digest()
    assert [len(level) for level in levels] == [130, 65, 33, 17, 9, 5, 3, 2]
    gen = torch.Generator().manual_seed(1)
    big = torch.randint(-(2**31), 2**31, (300, 8), dtype=torch.int32, generator=gen)
    nodes = [tuple(int(w) & M32 for w in row) for row in big.tolist()]
    assert b3gpu.cv_bytes(b3gpu.parents(big)) == packed(ref_parents(nodes))


# BLAKE3's test_vectors/test_vectors.json: input byte i is i % 251; the hash field's first 32 bytes
VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    1: "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
    1024: "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
    1025: "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
    8193: "bab6c09cb8ce8cf459261398d2e7aef35700bf488116ceb94a36d0f5f1b7bc3b",
}


@pytest.mark.parametrize("n", sorted(VECTORS))
def test_published_vectors(n):
    digest, _ = b3gpu.tree(u8(pattern(n)))
    assert digest.hex() == VECTORS[n]


def _host_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the same 2 bytes per element
    return t.numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64, torch.uint8])
def test_tensor_tree_dtypes(dtype):
    gen = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        t = torch.randn(41, 23, generator=gen).to(dtype)
    else:
        hi = 256 if dtype == torch.uint8 else 2**62
        t = torch.randint(0, hi, (41, 23), generator=gen).to(dtype)
    t = t.t()  # not contiguous: hashed in the order of its contiguous copy
    digest, levels = b3gpu.tensor_tree(t)
    assert digest == blake3.blake3(_host_bytes(t)).digest()
    assert len(levels) == 0 or levels[0].shape[0] == -(-t.numel() * t.element_size() // 1024)


def test_tensor_tree_scalar_and_empty():
    assert b3gpu.tensor_tree(torch.tensor(3.5))[0] == blake3.blake3(struct.pack("<f", 3.5)).digest()
    assert b3gpu.tensor_tree(torch.zeros(0, 5))[0] == blake3.blake3(b"").digest()


def test_chunk_cvs_counter():
    # counters across 2**32: the high word (t1) of the 64-bit counter must be set
    data = random.Random(5).randbytes(3 * 1024 + 100)
    counter = 2**32 - 2
    got = b3gpu.chunk_cvs(u8(data), counter)
    assert got.shape == (4, 8) and got.dtype == torch.int32
    assert b3gpu.cv_bytes(got) == packed(ref_cvs(data, counter))
    small = b"witness" * 9
    assert b3gpu.cv_bytes(b3gpu.chunk_cvs(u8(small), 7)) == packed(ref_cvs(small, 7))


def test_parents_odd_count():
    gen = torch.Generator().manual_seed(2)
    nodes = torch.randint(-(2**31), 2**31, (5, 8), dtype=torch.int32, generator=gen)
    host = [tuple(int(w) & M32 for w in row) for row in nodes.tolist()]
    up = b3gpu.parents(nodes)
    assert up.shape == (3, 8)
    assert b3gpu.cv_bytes(up) == packed(ref_parents(host))
    assert torch.equal(up[2], nodes[4])  # the odd last node is promoted unchanged
    assert torch.equal(b3gpu.parents(nodes[:1]), nodes[:1])
    assert b3gpu.cv_bytes(b3gpu.parents(nodes[:2])) == packed([ref_parent(host[0], host[1])])


def test_bad_inputs():
    with pytest.raises(ValueError):
        b3gpu.chunk_cvs(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError):
        b3gpu.chunk_cvs(torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        b3gpu.parents(torch.zeros(3, 7, dtype=torch.int32))
    with pytest.raises(ValueError):
        b3gpu.parents(torch.zeros(0, 8, dtype=torch.int32))
    with pytest.raises(ValueError):
        b3gpu.chunk_cvs(torch.zeros(4, dtype=torch.uint8), -1)


def test_without_triton_raises(monkeypatch):
    monkeypatch.setattr(b3gpu, "triton", None)
    with pytest.raises(RuntimeError, match="triton"):
        b3gpu.chunk_cvs(torch.zeros(4, dtype=torch.uint8))


def test_matches_c_module():
    native = pytest.importorskip("witness.commit._blake3")
    data = random.Random(11).randbytes(9 * 1024 + 17)
    digest, levels = b3gpu.tree(u8(data))
    assert digest == blake3.blake3(data).digest()
    assert b3gpu.cv_bytes(levels[0]) == native.chunk_cvs(data, 0)
    for below, above in zip(levels, levels[1:], strict=False):
        nodes = b3gpu.cv_bytes(below)
        whole = len(nodes) // 64 * 64  # the C module takes whole pairs; the odd node is promoted
        assert native.parents(nodes[:whole], None) + nodes[whole:] == b3gpu.cv_bytes(above)
    assert native.parents(b3gpu.cv_bytes(levels[-1]), b"\x01") == digest  # the ROOT flag
    counter = 2**32 - 1
    assert b3gpu.cv_bytes(b3gpu.chunk_cvs(u8(data), counter)) == native.chunk_cvs(data, counter)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from witness.fingerprint import b3gpu
assert isinstance(b3gpu._chunk_kernel, triton.runtime.JITFunction)
p = "*i32"
chunk = {"main_ptr": p, "tail_ptr": p, "out_ptr": p, "n": "i32", "n_full": "i32", "last_len": "i32",
         "counter": "i64", "root_flags": "i32", "max_blocks": "i32", "LANES": "constexpr"}
parent = {"in_ptr": p, "out_ptr": p, "m": "i32", "root_flags": "i32", "LANES": "constexpr"}
for fn, sig in ((b3gpu._chunk_kernel, chunk), (b3gpu._parent_kernel, parent)):
    src = ASTSource(fn=fn, signature=sig, constexprs={"LANES": 128})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"]
print("compiled")
"""


def test_kernels_compile_for_cuda():
    # the interpreter runs the kernels as numpy; this compiles them as for a GPU (an sm_90 cubin,
    # with the ptxas in triton's wheel; no device needed), in a process without TRITON_INTERPRET
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a warning; the kernels use no floats
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-4000:]


def test_a_state_hashed_by_the_kernels_is_the_hosts_state_tree_and_opens_the_same(monkeypatch):
    """The recorder's GPU path (hashed_by "cuda"), run here by the interpreter on CPU tensors: the state
    tree from the kernels' digests and kept levels has the host's root, and every chunk's opening is the
    same bytes; what a GPU state keeps on the host (AdamW's step counters, here the 0-dimensional tensors)
    is hashed on the host; the recorder picks the kernels for a CUDA device where Triton is installed."""
    from witness.bundle import opened
    from witness.bundle.opened import StateTree, hasher_for
    from witness.bundle.state import state_hash, state_tensors
    from witness.fingerprint.chunks import ChunkLayout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 160), torch.nn.Linear(160, 3))  # 80 chunks, and 1-chunk ones
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    tensors = state_tensors(model, opt)
    layout = ChunkLayout.of_model(model)
    flat = layout.flatten(tensors)
    host = StateTree(tensors, "blake3", layout, flat)
    on_kernels = []
    monkeypatch.setattr(opened, "on_gpu", lambda t: (on_kernels.append(t.dim()), t.dim() > 0)[1])
    device = StateTree(tensors, "blake3", layout, flat, hasher="cuda")
    assert 0 in on_kernels and max(on_kernels) > 0  # the step counters on the host, the rest on the kernels
    assert device.root == host.root == state_hash(tensors, "blake3")
    chunks = list(range(layout.size))
    assert np.array_equal(device.paths(chunks), host.paths(chunks))
    # the opened tensors' upper levels stay where the kernels made them (a path copies its nodes over)
    big = device.pieces.trees["model.0.weight"]
    assert isinstance(big, opened.DeviceTree) and all(isinstance(lv, torch.Tensor) for lv in big.levels)
    assert big.levels and not hasattr(big, "_raw_kept")
    both = opened.window_paths([device, host], chunks)
    assert np.array_equal(both[0], both[1]) and np.array_equal(both[0], host.paths(chunks))
    assert hasher_for(torch.device("cpu")) == "host" and hasher_for(torch.device("cuda")) == "cuda"


def test_a_ranks_share_hashed_by_the_kernels_is_the_hosts(monkeypatch, tmp_path):
    """Over ranks on GPUs (hashed_by "cuda"), each rank hashes its live pieces where they lie and keeps the
    ring's host copy for a path's bytes: the same digests and the same paths as hashing the copy on the host
    (run here by the interpreter on CPU tensors)."""
    from witness.bundle import opened
    from witness.bundle.state import state_tensors
    from witness.distributed.online import ShareRing
    from witness.fingerprint.chunks import ChunkLayout

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    pieces = state_tensors(model, opt)
    layout = ChunkLayout.of_model(model)
    host = ShareRing(tmp_path / "h", 1, 4, 10, layout, tree=True).keep(1, pieces)
    monkeypatch.setattr(opened, "on_gpu", lambda t: t.dim() > 0)
    device = ShareRing(tmp_path / "d", 1, 4, 10, layout, tree=True, hashed_by="cuda").keep(1, pieces)
    assert device.hex == host.hex
    assert any(isinstance(t, opened.DeviceTree) for t in device.trees.values())
    for c in range(layout.size):
        assert np.array_equal(device.path(c), host.path(c))
