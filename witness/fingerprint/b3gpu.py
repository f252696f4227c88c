"""BLAKE3's tree of a tensor's bytes, computed where the tensor lies (Triton kernels).

The input is cut into 1024-byte chunks; every chunk's chaining value (CV) is computed in parallel
(lanes = chunks), then the tree is built one level at a time: pairs (2i, 2i+1) become a parent, and
an odd last node is promoted unchanged (this is BLAKE3's tree: the left subtree always holds the
largest power of two of chunks). The one compression that makes the root carries the ROOT flag,
so the digest equals ``blake3.blake3(data).digest()``. Every level stays on the device; only the
32 digest bytes are copied to the host.

CV words are returned as ``int32`` tensors holding the bit pattern of BLAKE3's little-endian
``uint32`` words (torch has no general uint32 arithmetic); ``cv_bytes`` turns them into bytes.

Triton is an optional extra (``witness[gpu]``). Importing this module works without it; the
functions then raise RuntimeError. Triton picks its interpreter (``TRITON_INTERPRET=1``, which
runs the kernels on CPU tensors) when the kernels are defined, i.e. when this module is imported,
so set the variable before the first import.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the GPU extra is not installed: the module imports, its functions raise
    triton = tl = None

__all__ = ["chunk_cvs", "parents", "tree", "cv_bytes", "tensor_tree", "available", "CHUNK_LEN"]

CHUNK_LEN = 1024  # bytes per chunk: 16 blocks of 64 bytes
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
# chunks (or parent nodes) per program: with 4 warps one lane per thread, whose ~40 live words
# (8 cv, 16 message, 16 state) stay in registers
_LANES = 128
_WARPS = 4

if triton is not None:

    @triton.jit
    def _g(a, b, c, d, mx, my):
        # BLAKE3's adds wrap mod 2**32 on purpose: `x + y` would ask for overflow sanitizing (device
        # asserts under debug=True, four extra int64 ops per add in the interpreter). Words are
        # uint32: >> is logical and << drops the high bits, so (x >> n) | (x << 32-n) is a rotation
        # (written out, not a helper: each jit call costs the interpreter ~0.3 ms)
        a = tl.add(tl.add(a, b, sanitize_overflow=False), mx, sanitize_overflow=False)
        d = d ^ a
        d = (d >> 16) | (d << 16)
        c = tl.add(c, d, sanitize_overflow=False)
        b = b ^ c
        b = (b >> 12) | (b << 20)
        a = tl.add(tl.add(a, b, sanitize_overflow=False), my, sanitize_overflow=False)
        d = d ^ a
        d = (d >> 8) | (d << 24)
        c = tl.add(c, d, sanitize_overflow=False)
        b = b ^ c
        b = (b >> 7) | (b << 25)
        return a, b, c, d

    @triton.jit
    def _compress(h0, h1, h2, h3, h4, h5, h6, h7,
                  m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
                  t0, t1, blen, flags):
        # the first 8 output words (the next cv) of BLAKE3's compression; every argument is a
        # [lanes] uint32 tensor, one lane per chunk or parent
        v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
        v8 = tl.full(h0.shape, 0x6A09E667, tl.uint32)
        v9 = tl.full(h0.shape, 0xBB67AE85, tl.uint32)
        v10 = tl.full(h0.shape, 0x3C6EF372, tl.uint32)
        v11 = tl.full(h0.shape, 0xA54FF53A, tl.uint32)
        v12, v13, v14, v15 = t0, t1, blen, flags
        for _r in tl.static_range(7):  # unrolled: the permutation below is a renaming, no moves
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
            # message permutation [2,6,3,10,7,0,4,13,1,11,12,5,9,14,15,8]
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15 = (
                m2, m6, m3, m10, m7, m0, m4, m13, m1, m11, m12, m5, m9, m14, m15, m8)
        return (v0 ^ v8, v1 ^ v9, v2 ^ v10, v3 ^ v11, v4 ^ v12, v5 ^ v13, v6 ^ v14, v7 ^ v15)

    @triton.jit
    def _iv(shape: tl.constexpr):
        return (tl.full(shape, 0x6A09E667, tl.uint32), tl.full(shape, 0xBB67AE85, tl.uint32),
                tl.full(shape, 0x3C6EF372, tl.uint32), tl.full(shape, 0xA54FF53A, tl.uint32),
                tl.full(shape, 0x510E527F, tl.uint32), tl.full(shape, 0x9B05688C, tl.uint32),
                tl.full(shape, 0x1F83D9AB, tl.uint32), tl.full(shape, 0x5BE0CD19, tl.uint32))

    @triton.jit
    def _word(main_ptr, tail_ptr, moff, toff, in_main, in_tail):
        # a lane reads its word from the full chunks or from the zero-padded copy of the partial
        # last chunk; the other load is masked off (no memory access) and yields 0
        w = tl.load(main_ptr + moff, mask=in_main, other=0)
        w = w | tl.load(tail_ptr + toff, mask=in_tail, other=0)
        return w.to(tl.uint32, bitcast=True)

    @triton.jit
    def _chunk_kernel(main_ptr, tail_ptr, out_ptr, n, n_full, last_len, counter, root_flags,
                      max_blocks, LANES: tl.constexpr):
        c = tl.program_id(0) * LANES + tl.arange(0, LANES)
        live = c < n
        c64 = c.to(tl.int64)  # word offsets pass 2**31 past 8 GiB of input
        ctr = c64 + counter  # the 64-bit chunk counter, split into two words
        t0 = (ctr & 0xFFFFFFFF).to(tl.uint32)
        t1 = (ctr >> 32).to(tl.uint32)
        length = tl.where(c == n - 1, last_len, 1024)
        nblk = tl.maximum((length + 63) // 64, 1)  # an empty input is one block of 0 bytes
        in_main = live & (c < n_full)
        in_tail = live & (c == n_full)
        zero = tl.full([LANES], 0, tl.int32)
        h0, h1, h2, h3, h4, h5, h6, h7 = _iv([LANES])
        for b in range(max_blocks):  # 16, or fewer when the only chunk is short
            mo = c64 * 256 + b * 16
            to = zero + b * 16
            m0 = _word(main_ptr, tail_ptr, mo + 0, to + 0, in_main, in_tail)
            m1 = _word(main_ptr, tail_ptr, mo + 1, to + 1, in_main, in_tail)
            m2 = _word(main_ptr, tail_ptr, mo + 2, to + 2, in_main, in_tail)
            m3 = _word(main_ptr, tail_ptr, mo + 3, to + 3, in_main, in_tail)
            m4 = _word(main_ptr, tail_ptr, mo + 4, to + 4, in_main, in_tail)
            m5 = _word(main_ptr, tail_ptr, mo + 5, to + 5, in_main, in_tail)
            m6 = _word(main_ptr, tail_ptr, mo + 6, to + 6, in_main, in_tail)
            m7 = _word(main_ptr, tail_ptr, mo + 7, to + 7, in_main, in_tail)
            m8 = _word(main_ptr, tail_ptr, mo + 8, to + 8, in_main, in_tail)
            m9 = _word(main_ptr, tail_ptr, mo + 9, to + 9, in_main, in_tail)
            m10 = _word(main_ptr, tail_ptr, mo + 10, to + 10, in_main, in_tail)
            m11 = _word(main_ptr, tail_ptr, mo + 11, to + 11, in_main, in_tail)
            m12 = _word(main_ptr, tail_ptr, mo + 12, to + 12, in_main, in_tail)
            m13 = _word(main_ptr, tail_ptr, mo + 13, to + 13, in_main, in_tail)
            m14 = _word(main_ptr, tail_ptr, mo + 14, to + 14, in_main, in_tail)
            m15 = _word(main_ptr, tail_ptr, mo + 15, to + 15, in_main, in_tail)
            blen = tl.minimum(tl.maximum(length - b * 64, 0), 64)
            last = nblk - 1 == b
            # CHUNK_START = 1 on the first block, CHUNK_END = 2 (and ROOT if asked) on the last
            flags = tl.where(last, 2 + root_flags, 0) + tl.where(b == 0, 1, 0)
            g0, g1, g2, g3, g4, g5, g6, g7 = _compress(
                h0, h1, h2, h3, h4, h5, h6, h7,
                m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
                t0, t1, blen.to(tl.uint32), flags.to(tl.uint32))
            # only the partial last chunk has fewer blocks; its lane keeps its cv past its end
            act = b < nblk
            h0 = tl.where(act, g0, h0)
            h1 = tl.where(act, g1, h1)
            h2 = tl.where(act, g2, h2)
            h3 = tl.where(act, g3, h3)
            h4 = tl.where(act, g4, h4)
            h5 = tl.where(act, g5, h5)
            h6 = tl.where(act, g6, h6)
            h7 = tl.where(act, g7, h7)
        o = c64 * 8
        tl.store(out_ptr + o + 0, h0.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 1, h1.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 2, h2.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 3, h3.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 4, h4.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 5, h5.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 6, h6.to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 7, h7.to(tl.int32, bitcast=True), mask=live)

    @triton.jit
    def _ld(ptr, off, mask):
        return tl.load(ptr + off, mask=mask, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def _parent_kernel(in_ptr, out_ptr, m, root_flags, LANES: tl.constexpr):
        i = tl.program_id(0) * LANES + tl.arange(0, LANES)
        live = i < (m + 1) // 2
        pair = live & (2 * i + 1 < m)  # the odd last node has no right sibling
        lo = i.to(tl.int64) * 16  # nodes 2i and 2i+1 are 16 consecutive words
        m0 = _ld(in_ptr, lo + 0, live)
        m1 = _ld(in_ptr, lo + 1, live)
        m2 = _ld(in_ptr, lo + 2, live)
        m3 = _ld(in_ptr, lo + 3, live)
        m4 = _ld(in_ptr, lo + 4, live)
        m5 = _ld(in_ptr, lo + 5, live)
        m6 = _ld(in_ptr, lo + 6, live)
        m7 = _ld(in_ptr, lo + 7, live)
        m8 = _ld(in_ptr, lo + 8, pair)
        m9 = _ld(in_ptr, lo + 9, pair)
        m10 = _ld(in_ptr, lo + 10, pair)
        m11 = _ld(in_ptr, lo + 11, pair)
        m12 = _ld(in_ptr, lo + 12, pair)
        m13 = _ld(in_ptr, lo + 13, pair)
        m14 = _ld(in_ptr, lo + 14, pair)
        m15 = _ld(in_ptr, lo + 15, pair)
        h0, h1, h2, h3, h4, h5, h6, h7 = _iv([LANES])
        zero = tl.full([LANES], 0, tl.uint32)
        g0, g1, g2, g3, g4, g5, g6, g7 = _compress(
            h0, h1, h2, h3, h4, h5, h6, h7,
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
            zero, zero, zero + 64, zero + 4 + root_flags)  # PARENT = 4
        o = i.to(tl.int64) * 8
        # a promoted node is its left half, copied unchanged
        tl.store(out_ptr + o + 0, tl.where(pair, g0, m0).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 1, tl.where(pair, g1, m1).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 2, tl.where(pair, g2, m2).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 3, tl.where(pair, g3, m3).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 4, tl.where(pair, g4, m4).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 5, tl.where(pair, g5, m5).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 6, tl.where(pair, g6, m6).to(tl.int32, bitcast=True), mask=live)
        tl.store(out_ptr + o + 7, tl.where(pair, g7, m7).to(tl.int32, bitcast=True), mask=live)


def _require_triton(t: torch.Tensor) -> None:
    """Raise a clear error where the kernels cannot run on ``t``."""
    if triton is None:
        raise RuntimeError("witness.fingerprint.b3gpu needs triton: pip install 'witness[gpu]'")
    # the interpreter copies any tensor to the host; compiled kernels need a GPU tensor
    interpreted = not isinstance(_chunk_kernel, triton.runtime.JITFunction)
    if not interpreted and t.device.type != "cuda":
        raise RuntimeError(f"BLAKE3 kernels need a CUDA tensor, got {t.device} (a CPU tensor "
                           "runs only under TRITON_INTERPRET=1, set before importing this module)")


def _words(head: torch.Tensor) -> torch.Tensor:
    """The whole chunks' bytes as int32 words, copied only where the view is not 4-byte aligned."""
    if head.data_ptr() % 4 == 0:
        try:
            return head.view(torch.int32)
        except RuntimeError:  # aligned, but torch wants the storage offset a multiple of 4 too
            pass
    return head.clone().view(torch.int32)


def _chunks(data: torch.Tensor, counter: int, root_flags: int) -> torch.Tensor:
    """Launch the chunk kernel: [n, 8] CV words, the last block of each chunk with root_flags."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("data must be a 1-D uint8 tensor (see tensor_tree for other dtypes)")
    _require_triton(data)
    data = data.contiguous()
    nbytes = data.numel()
    n = max(1, -(-nbytes // CHUNK_LEN))
    if counter < 0 or counter + n > 2**63 - 1:
        raise ValueError(f"chunk counter {counter} out of range")
    n_full = nbytes // CHUNK_LEN
    # the partial last chunk: a zero-padded copy of only the tail, so no lane reads past the end
    tail = torch.zeros(CHUNK_LEN, dtype=torch.uint8, device=data.device)
    tail[: nbytes - n_full * CHUNK_LEN] = data[n_full * CHUNK_LEN:]
    tail = tail.view(torch.int32)
    main = _words(data[: n_full * CHUNK_LEN]) if n_full else tail  # masked off when n_full == 0
    out = torch.empty((n, 8), dtype=torch.int32, device=data.device)
    last_len = nbytes - (n - 1) * CHUNK_LEN
    max_blocks = 16 if n > 1 else max(1, -(-last_len // 64))
    grid = (-(-n // _LANES),)
    _chunk_kernel[grid](main, tail, out, n, n_full, last_len, counter, root_flags, max_blocks,
                        LANES=_LANES, num_warps=_WARPS)
    return out


def _parents(nodes: torch.Tensor, root_flags: int) -> torch.Tensor:
    """Launch the parent kernel: [m, 8] -> [ceil(m/2), 8], each parent with root_flags."""
    if (not isinstance(nodes, torch.Tensor) or nodes.dtype != torch.int32 or nodes.dim() != 2
            or nodes.shape[1] != 8 or nodes.shape[0] < 1):
        raise ValueError("nodes must be an [m, 8] int32 tensor with m >= 1")
    _require_triton(nodes)
    nodes = nodes.contiguous()
    m = nodes.shape[0]
    out = torch.empty(((m + 1) // 2, 8), dtype=torch.int32, device=nodes.device)
    grid = (-(-out.shape[0] // _LANES),)
    _parent_kernel[grid](nodes, out, m, root_flags, LANES=_LANES, num_warps=_WARPS)
    return out


def chunk_cvs(data: torch.Tensor, counter: int = 0) -> torch.Tensor:
    """The non-root CVs of every 1024-byte chunk of ``data`` ([n, 8] int32), chunk i at counter+i."""
    return _chunks(data, counter, 0)


def parents(nodes: torch.Tensor) -> torch.Tensor:
    """One tree level up: pairs (2i, 2i+1) compressed as non-root parents, an odd last promoted."""
    return _parents(nodes, 0)


def cv_bytes(words: torch.Tensor) -> bytes:
    """The little-endian bytes of [m, 8] CV words, 32 bytes per node."""
    if words.dim() != 2 or words.shape[1] != 8 or words.dtype != torch.int32:
        raise ValueError("words must be an [m, 8] int32 tensor")
    return words.detach().cpu().contiguous().numpy().astype("<i4", copy=False).tobytes()


def tree(data: torch.Tensor) -> tuple[bytes, list[torch.Tensor]]:
    """The BLAKE3 digest of ``data`` (1-D uint8) and every tree level below the root, on device.

    ``levels[0]`` is the chunk CVs, each next level is ``parents`` of the one before, and the last
    level holds the root's two children. The root itself is not in the list, so a one-chunk input
    (the root is that chunk, compressed with ROOT) gives ``[]``.
    """
    n = max(1, -(-data.numel() // CHUNK_LEN))
    if n == 1:
        return cv_bytes(_chunks(data, 0, ROOT)), []
    levels = [_chunks(data, 0, 0)]
    while levels[-1].shape[0] > 2:
        levels.append(_parents(levels[-1], 0))
    return cv_bytes(_parents(levels[-1], ROOT)), levels


def available() -> bool:
    """Whether Triton is installed (the kernels then run on CUDA tensors, or under its interpreter)."""
    return triton is not None


def tensor_tree(t: torch.Tensor) -> tuple[bytes, list[torch.Tensor]]:
    """``tree`` of a tensor's raw bytes (any dtype), in its memory order once made contiguous."""
    return tree(t.detach().contiguous().reshape(-1).view(torch.uint8))
