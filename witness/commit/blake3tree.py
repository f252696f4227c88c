"""BLAKE3 as a Merkle tree: a buffer's digest, the chaining values of its 1 KiB chunks and of the
parents above them, the paths that open one chunk, and the check of many paths at once. No torch.

BLAKE3 hashes a buffer as a tree of 1,024-byte chunks: each chunk's chaining value (CV) is its
compression with the chunk's index as the counter, a parent's CV the compression of its two
children's, the left subtree the largest power of two of chunks below the total (the tree built level
by level, an odd last node promoted unchanged: RFC 6962's shape), and the ROOT flag only on the
compression that makes the digest. So a tensor's BLAKE3 digest, which the state hash already holds,
commits every chunk of it, and a chunk is opened by its sibling CVs up to the root. A CV passed off
as the root, or the root as a CV, is refused by the flags alone.

The native module (``_blake3.c``) computes it; where it was not built, the numpy twin below gives
the same bytes, slower. ``NATIVE`` says which one runs.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .chunks import level_sizes, path_nodes

try:
    from . import _blake3
except ImportError:  # built optionally (setup.py): no compiler there
    _blake3 = None
if os.environ.get("WITNESS_NATIVE") == "0":  # the twin, to compare or to measure
    _blake3 = None

NATIVE = _blake3 is not None
CHUNK = 1024
# below this level the trainer keeps no nodes: a path's lower nodes come from the chunks of the 16 KiB
# around the opened one, hashed again (the kept levels are then 1/512 of the bytes, not 1/16)
KEEP_FROM = 4
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
IV = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19],
              dtype=np.uint32)
_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)


def _schedule() -> list[list[int]]:
    rows = [list(range(16))]
    for _ in range(6):
        rows.append([rows[-1][p] for p in _PERMUTATION])
    return rows


_SCHEDULE = _schedule()


def chunk_count(nbytes: int) -> int:
    """The chunks of a buffer of ``nbytes`` bytes (an empty one is one chunk of nothing)."""
    return max(1, -(-nbytes // CHUNK))


# --- the numpy twin ---------------------------------------------------------------------------

def _rotr(x: np.ndarray, c: int) -> np.ndarray:
    return (x >> np.uint32(c)) | (x << np.uint32(32 - c))


def _compress(cv: np.ndarray, m: np.ndarray, counter: np.ndarray, blen: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """The first 8 output words of R compressions at once: ``cv`` [R, 8], ``m`` [R, 16] uint32."""
    r = cv.shape[0]
    v = [cv[:, i].copy() for i in range(8)] + [np.full(r, IV[i], np.uint32) for i in range(4)]
    v += [(counter & 0xFFFFFFFF).astype(np.uint32), (counter >> np.uint64(32)).astype(np.uint32),
          blen.astype(np.uint32), flags.astype(np.uint32)]
    words = [m[:, i] for i in range(16)]

    def g(a: int, b: int, c: int, d: int, x: np.ndarray, y: np.ndarray) -> None:
        v[a] = v[a] + v[b] + x
        v[d] = _rotr(v[d] ^ v[a], 16)
        v[c] = v[c] + v[d]
        v[b] = _rotr(v[b] ^ v[c], 12)
        v[a] = v[a] + v[b] + y
        v[d] = _rotr(v[d] ^ v[a], 8)
        v[c] = v[c] + v[d]
        v[b] = _rotr(v[b] ^ v[c], 7)

    with np.errstate(over="ignore"):
        for s in _SCHEDULE:
            for i, (a, b, c, d) in enumerate(((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                                              (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))):
                g(a, b, c, d, words[s[2 * i]], words[s[2 * i + 1]])
    return np.stack([v[i] ^ v[i + 8] for i in range(8)], axis=1)


def _chunks_np(rows: np.ndarray, lengths: np.ndarray, counters: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """The twin of ``_blake3.chunks``: R chunks (rows [R, 1024]) hashed at once, [R, 32]."""
    r = rows.shape[0]
    cv = np.tile(IV, (r, 1))
    blocks = np.maximum(1, -(-lengths // 64))
    for b in range(int(blocks.max(initial=1))):
        live = b < blocks
        last = b + 1 == blocks
        blen = np.clip(lengths - 64 * b, 0, 64)
        # BLAKE3 hashes a block's bytes past the length as zeros, whatever a row holds there (as the native one)
        block = np.where(np.arange(64) < blen[:, None], rows[:, 64 * b:64 * b + 64], 0).astype(np.uint8)
        m = np.ascontiguousarray(block).view("<u4").astype(np.uint32)
        flags = np.where(b == 0, CHUNK_START, 0) | np.where(last, CHUNK_END | np.where(roots, ROOT, 0), 0)
        out = _compress(cv, m, counters.astype(np.uint64), blen, flags)
        cv = np.where(live[:, None], out, cv)
    return cv.astype("<u4").view(np.uint8).reshape(r, 32)


def _parents_np(pairs: np.ndarray, roots: np.ndarray) -> np.ndarray:
    m = pairs.reshape(-1, 64).view("<u4").astype(np.uint32)
    r = m.shape[0]
    out = _compress(np.tile(IV, (r, 1)), m, np.zeros(r, np.uint64), np.full(r, 64, np.uint32),
                    np.where(roots, PARENT | ROOT, PARENT))
    return out.astype("<u4").view(np.uint8).reshape(r, 32)


def _rows(data: np.ndarray, counter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A buffer as zero-padded chunk rows, their lengths and counters."""
    n = max(1, -(-data.size // CHUNK))
    rows = np.zeros(n * CHUNK, np.uint8)
    rows[:data.size] = data
    lengths = np.minimum(CHUNK, np.maximum(0, data.size - CHUNK * np.arange(n, dtype=np.int64)))
    return rows.reshape(n, CHUNK), lengths, counter + np.arange(n, dtype=np.uint64)


# --- what the recorder and the verifier call ---------------------------------------------------

def _u8(data) -> np.ndarray:  # noqa: ANN001 - any buffer
    return np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)


def chunk_cvs(data, counter: int = 0, threads: int = 1) -> bytes:  # noqa: ANN001 - any buffer
    """Every chunk's CV (not a root) of ``data``, chunk i with counter ``counter + i``: 32 bytes each."""
    if _blake3 is not None:
        return _blake3.chunk_cvs(data, counter, threads)
    raw = _u8(data)
    if not raw.size:
        return b""
    rows, lengths, counters = _rows(raw, counter)
    return _chunks_np(rows, lengths, counters, np.zeros(len(rows), bool)).tobytes()


def parents(pairs, roots: np.ndarray | None = None, threads: int = 1) -> bytes:  # noqa: ANN001 - any buffer
    """Each 64-byte pair's parent CV, or (where ``roots`` is true) the root it makes."""
    if _blake3 is not None:
        return _blake3.parents(pairs, None if roots is None else np.ascontiguousarray(roots, np.uint8), threads)
    raw = _u8(pairs)
    m = raw.size // 64
    return _parents_np(raw, np.zeros(m, bool) if roots is None else np.asarray(roots, bool)).tobytes()


def chunk_outputs(rows: np.ndarray, lengths: np.ndarray, counters: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """The CVs (or, where ``roots``, the digests) of R chunks given as rows [R, 1024] holding ``lengths``
    bytes each, with their own ``counters``: [R, 32] uint8."""
    rows = np.ascontiguousarray(rows, np.uint8)
    lengths, counters = np.ascontiguousarray(lengths, np.int64), np.ascontiguousarray(counters, np.uint64)
    if _blake3 is not None:
        out = _blake3.chunks(rows, lengths, counters, np.ascontiguousarray(roots, np.uint8))
        return np.frombuffer(out, np.uint8).reshape(-1, 32)
    return _chunks_np(rows, lengths, counters, np.asarray(roots, bool))


def tree(data, keep_from: int = 0, threads: int = 1) -> tuple[bytes, bytes]:  # noqa: ANN001 - any buffer
    """``data``'s BLAKE3 digest, and the CVs of its tree's levels from ``keep_from`` up to the one below
    the root (level 0: the chunks), level after level; nothing below the root of a one-chunk buffer."""
    if _blake3 is not None:
        return _blake3.tree(data, keep_from, threads)
    raw = _u8(data)
    rows, lengths, counters = _rows(raw, 0)
    if len(rows) == 1:
        return _chunks_np(rows, lengths, counters, np.ones(1, bool)).tobytes(), b""
    level = _chunks_np(rows, lengths, counters, np.zeros(len(rows), bool))
    kept = []
    for lv in range(len(level_sizes(len(rows))) - 1):
        if lv >= keep_from:
            kept.append(level.tobytes())
        if len(level) == 2:
            break
        up = _parents_np(level[:len(level) // 2 * 2].reshape(-1), np.zeros(len(level) // 2, bool))
        level = np.concatenate([up, level[len(level) // 2 * 2:]])
    return _parents_np(level.reshape(-1), np.ones(1, bool)).tobytes(), b"".join(kept)


def trees(buffers: list, keep_froms: list[int]) -> list[tuple[bytes, bytes]]:
    """``tree(buffer, keep_from)`` of many buffers in one native call (a state's many small tensors), each
    with its own ``keep_from`` (one above a buffer's levels keeps nothing: its digest alone)."""
    if _blake3 is not None:
        return _blake3.trees(buffers, keep_froms)
    return [tree(b, k) for b, k in zip(buffers, keep_froms, strict=True)]


def digests(buffers: list, threads: int = 1) -> list[bytes]:
    """Each buffer's BLAKE3 digest: one native call for them all (a state's many small tensors)."""
    if _blake3 is not None:
        return _blake3.digests(buffers, threads)
    return [tree(b, 1 << 30)[0] for b in buffers]


def digest(data, threads: int = 1) -> bytes:  # noqa: ANN001 - any buffer
    """``data``'s BLAKE3 digest (the ``blake3`` package's)."""
    return tree(data, 1 << 30, threads)[0]


@functools.lru_cache(maxsize=1 << 12)
def _level_starts(size: int, keep_from: int) -> dict[int, int]:
    """Where each kept level of a tree of ``size`` chunks begins among its kept nodes."""
    sizes = level_sizes(size)[:-1]
    return {lv: int(s) for lv, s in zip(range(keep_from, len(sizes)), np.cumsum([0, *sizes[keep_from:]]),
                                        strict=False)}


class TensorTree:
    """One buffer's BLAKE3 tree as the trainer keeps it: its digest and the levels from ``KEEP_FROM``
    up; a path's lower nodes are hashed again from the buffer's bytes around the opened chunk."""

    def __init__(self, data, threads: int = 1, keep_from: int = KEEP_FROM):  # noqa: ANN001 - any buffer
        # (a tree is built for every parameter at every step, and opened for a few: the rest is lazy)
        self.size = chunk_count(data.nbytes if isinstance(data, np.ndarray) else len(memoryview(data).cast("B")))
        self.keep_from = keep_from
        self.digest, self._raw_kept = tree(data, keep_from, threads)

    @classmethod
    def from_parts(cls, size: int, digest: bytes, kept: bytes, keep_from: int = KEEP_FROM) -> TensorTree:
        """A tree hashed elsewhere (on a GPU: ``witness.fingerprint.b3gpu``): its chunks, its digest and its
        levels from ``keep_from`` up, as ``tree`` gives them."""
        out = cls.__new__(cls)
        out.size, out.keep_from, out.digest, out._raw_kept = size, keep_from, digest, kept
        return out

    def kept(self, level: int, pos: int) -> np.ndarray:
        """Node ``pos`` of kept level ``level`` (>= ``keep_from``) as [32] uint8."""
        return self.kept_nodes([(level, pos)])[0]

    def kept_nodes(self, wanted: list[tuple[int, int]]) -> np.ndarray:
        """Nodes (level, position) of the kept levels, as [k, 32] uint8 (a tree whose levels stay on a GPU
        copies these alone to the host)."""
        kept = np.frombuffer(self._raw_kept, np.uint8).reshape(-1, 32)
        starts = self._level_starts()
        return kept[[starts[lv] + pos for lv, pos in wanted]] if wanted else np.zeros((0, 32), np.uint8)

    def _level_starts(self) -> dict[int, int]:
        return _level_starts(self.size, self.keep_from)

    def path(self, index: int, data) -> np.ndarray:  # noqa: ANN001 - the same buffer's bytes
        """The sibling CVs of chunk ``index``, bottom up ([nodes, 32]); ``data`` the buffer hashed."""
        raw = _u8(data)
        span = 1 << self.keep_from
        lo = index // span * span
        hi = min(self.size, lo + span)
        local = np.frombuffer(chunk_cvs(raw[lo * CHUNK:min(raw.size, hi * CHUNK)], lo), np.uint8).reshape(-1, 32)
        levels = [local]
        while len(levels) < self.keep_from and len(levels[-1]) > 1:  # the block's own levels (aligned: same shape)
            lv = levels[-1]
            up = np.frombuffer(parents(lv[:len(lv) // 2 * 2].tobytes()), np.uint8).reshape(-1, 32)
            levels.append(np.concatenate([up, lv[len(lv) // 2 * 2:]]))
        nodes = path_nodes(index, self.size)
        upper = iter(self.kept_nodes([(lv, pos) for lv, pos in nodes if lv >= self.keep_from]))
        out = [levels[lv][pos - (lo >> lv)] if lv < self.keep_from else next(upper) for lv, pos in nodes]
        return np.stack(out) if out else np.zeros((0, 32), np.uint8)


def path_lengths(index: np.ndarray, size: np.ndarray) -> np.ndarray:
    """How many sibling CVs the path of each chunk ``index`` of a buffer of ``size`` chunks holds."""
    index, size = np.asarray(index, np.int64), np.asarray(size, np.int64).copy()
    out = np.zeros(index.shape, np.int64)
    level = 0
    while (size > 1).any():
        out += ((index >> level) ^ 1) < size
        size = np.where(size > 1, (size + 1) // 2, size)
        level += 1
    return out


def path_roots(rows: np.ndarray, lengths: np.ndarray, index: np.ndarray, size: np.ndarray, nodes: np.ndarray,
               starts: np.ndarray) -> np.ndarray:
    """The digest each of R openings leads to: ``rows`` [R, 1024] the chunks (``lengths`` bytes each),
    ``index`` their chunk in a buffer of ``size`` chunks (each row its own buffer), ``nodes`` [M, 32]
    every path's sibling CVs, ``starts`` where each row's path begins (its length is ``path_lengths``).
    The ROOT flag goes on each row's last compression only, level by level for all rows at once."""
    index, size = np.asarray(index, np.int64), np.asarray(size, np.int64)
    lens = path_lengths(index, size)
    cur = chunk_outputs(rows, lengths, index.astype(np.uint64), lens == 0).copy()
    ptr = np.asarray(starts, np.int64).copy()
    done = np.zeros(len(index), np.int64)
    level, at = 0, size.copy()
    while (at > 1).any():
        pos = index >> level
        has = ((pos ^ 1) < at) & (at > 1)
        rows_ = np.nonzero(has)[0]
        if rows_.size:
            sib = nodes[ptr[rows_]]
            left = (pos[rows_] & 1).astype(bool)[:, None]
            pairs = np.concatenate([np.where(left, sib, cur[rows_]), np.where(left, cur[rows_], sib)], axis=1)
            done[rows_] += 1
            top = done[rows_] == lens[rows_]
            cur[rows_] = np.frombuffer(parents(np.ascontiguousarray(pairs), top), np.uint8).reshape(-1, 32)
            ptr[rows_] += 1
        at = np.where(at > 1, (at + 1) // 2, at)
        level += 1
    return cur
