"""SHA-256 of many small messages at once: the per-sample hashes of a dataset commitment.

Committing a pretraining corpus hashes every sample and every document, then builds an RFC 6962
tree over the samples. Hashed one ``hashlib`` call at a time, Python's per-call cost dominates
(13× a plain SHA-256 pass over the same bytes, measured at 10^6 samples). The native module
(``_native.c``, OpenSSL's SHA-256 in a loop over several threads, GIL released) hashes a whole
chunk per call. Where it was not built, the same functions run here in Python and give the same
bytes, only slower; ``NATIVE`` says which one runs.
"""

from __future__ import annotations

import hashlib
import os

from .hashing import LEAF_PREFIX, NODE_PREFIX

try:
    from . import _native
except ImportError:  # built optionally (setup.py): no compiler or no OpenSSL headers there
    _native = None
if os.environ.get("WITNESS_NATIVE") == "0":  # to measure (or rule out) the native module: the same bytes
    _native = None

NATIVE = _native is not None
Buffer = bytes | bytearray | memoryview


def cores() -> int:
    """The cores this process may run on: how many threads a batch is split over by default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _threads(threads: int | None) -> int:
    return max(1, min(64, threads or cores()))


def tagged_many(tag: str, data: Buffer, cut: int | Buffer, threads: int | None = None, *,
                spans: bool = False) -> bytes:
    """``tagged_hash(tag, m)`` of every message ``m`` of ``data``, as one ``bytes`` of 32-byte digests.

    The messages are ``data`` cut into ``cut``-byte pieces (an int), or, with ``cut`` a buffer of
    little-endian uint64: the spans between consecutive offsets (n + 1 of them), or with ``spans``
    the spans ``cut[2i]`` to ``cut[2i + 1]`` (2n of them, which may leave gaps between messages).
    """
    raw = tag.encode("ascii")
    if _native is not None:
        return _native.tagged(raw, data, cut, _threads(threads), spans)
    view = memoryview(data).cast("B")
    if isinstance(cut, int):
        if cut <= 0 or len(view) % cut:
            raise ValueError("data is not a whole number of messages of that width")
        pairs = [(i, i + cut) for i in range(0, len(view), cut)]
    else:
        o = memoryview(cut).cast("B").cast("Q")
        pairs = [(o[2 * i], o[2 * i + 1]) for i in range(len(o) // 2)] if spans else \
            [(o[i], o[i + 1]) for i in range(len(o) - 1)]
        if (spans and len(o) % 2) or (not spans and not len(o)) or \
                any(lo > hi or hi > len(view) for lo, hi in pairs):
            raise ValueError("offsets must ascend within the data")
    base = hashlib.sha256(raw + b"\x00")
    out = bytearray()
    for lo, hi in pairs:
        h = base.copy()
        h.update((hi - lo).to_bytes(8, "big"))
        h.update(view[lo:hi])
        out += h.digest()
    return bytes(out)


def tagged_windows(tag: str, keys: Buffer, tokens: Buffer, first: int, stride: int, token: int, width: int,
                   threads: int | None = None) -> bytes:
    """For every 32-byte key, the hash ``h = tagged_hash(tag, keys[i] ‖ (first + i·stride) as 8
    big-endian bytes ‖ window i)`` and then its leaf ``SHA-256(0x00 ‖ h ‖ keys[i])``: 64 bytes a
    window. Window i is ``width`` bytes of ``tokens`` from ``i·stride`` tokens of ``token`` bytes
    each (packed windows of a token stream, hashed without assembling their bytes)."""
    if _native is not None:
        return _native.windows(tag.encode("ascii"), keys, tokens, first, stride, token, width, _threads(threads))
    k, t = memoryview(keys).cast("B"), memoryview(tokens).cast("B")
    n = len(k) // 32
    if len(k) % 32 or token <= 0 or width < 0 or (n and (n - 1) * stride * token + width > len(t)):
        raise ValueError("windows must lie within the tokens, keys be 32-byte hashes")
    parts = [bytes(k[32 * i:32 * i + 32]) + (first + i * stride).to_bytes(8, "big") +
             bytes(t[i * stride * token:i * stride * token + width]) for i in range(n)]
    hashes = tagged_many(tag, b"".join(parts), 40 + width) if parts else b""
    out = bytearray()
    for i in range(n):
        h = hashes[32 * i:32 * i + 32]
        out += h + hashlib.sha256(LEAF_PREFIX + h + bytes(k[32 * i:32 * i + 32])).digest()
    return bytes(out)


def leaf_hashes(data: Buffer, width: int, threads: int | None = None) -> bytes:
    """The RFC 6962 leaf hash ``SHA-256(0x00 || record)`` of every ``width``-byte record of ``data``."""
    if _native is not None:
        return _native.leaves(data, width, _threads(threads))
    view = memoryview(data).cast("B")
    if width <= 0 or len(view) % width:
        raise ValueError("data is not a whole number of records of that width")
    return b"".join(hashlib.sha256(LEAF_PREFIX + view[i:i + width]).digest() for i in range(0, len(view), width))


def tree_root(leaves: Buffer, threads: int | None = None) -> bytes:
    """The RFC 6962 root over concatenated 32-byte leaf hashes (the empty tree's root for none)."""
    view = memoryview(leaves).cast("B")
    if len(view) % 32:
        raise ValueError("leaf hashes must be a whole number of 32-byte hashes")
    if not len(view):
        return hashlib.sha256(b"").digest()
    if _native is not None:
        return _native.root(view, _threads(threads))
    level = [bytes(view[i:i + 32]) for i in range(0, len(view), 32)]
    while len(level) > 1:
        nxt = [hashlib.sha256(NODE_PREFIX + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def node_hashes(pairs: Buffer, threads: int | None = None) -> bytes:
    """The RFC 6962 node hash ``SHA-256(0x01 || left || right)`` of every 64-byte pair of child hashes."""
    native = getattr(_native, "nodes", None)  # (a module built before it had nodes: Python's twin)
    if native is not None:
        return native(pairs, 64, _threads(threads))
    view = memoryview(pairs).cast("B")
    if len(view) % 64:
        raise ValueError("data is not a whole number of records of that width")
    return b"".join(hashlib.sha256(NODE_PREFIX + view[i:i + 64]).digest() for i in range(0, len(view), 64))


def tree_levels(leaves: Buffer, threads: int | None = None) -> bytes:
    """Every level of the RFC 6962 tree over concatenated 32-byte leaf hashes (at least one),
    concatenated from the leaves (level 0) to the root (the last 32 bytes), the odd node of a level
    promoted as ``tree_root`` does: what Merkle paths are read from."""
    view = memoryview(leaves).cast("B")
    if len(view) % 32 or not len(view):
        raise ValueError("leaf hashes must be a non-empty whole number of 32-byte hashes")
    native = getattr(_native, "levels", None)
    if native is not None:
        return native(view, _threads(threads))
    out = bytearray(view)
    level = bytes(view)
    while len(level) > 32:
        n = len(level) // 32
        up = node_hashes(level[:64 * (n // 2)]) + (level[-32:] if n % 2 else b"")
        out += up
        level = up
    return bytes(out)


class StreamingRoot:
    """The RFC 6962 root of a sequence of leaf hashes that arrives in chunks, in O(log n) memory.

    Each chunk must hold a power-of-two number of leaves (the same or fewer than the chunk before),
    except the last, which may hold any number: a tree's root is then the fold, from the right, of
    the roots of the perfect subtrees that the binary form of its size gives, and every full chunk
    is one of them (or merges with its equal neighbour into a larger one).
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.stack: list[tuple[int, bytes]] = []  # (leaves, root) of perfect subtrees, largest first
        self.size = 0
        self._last = False

    def add(self, leaves: Buffer) -> None:
        """Append a chunk of concatenated 32-byte leaf hashes."""
        n = len(memoryview(leaves).cast("B")) // 32
        if not n:
            return
        if self._last:
            raise ValueError("a chunk that is not a power of two must be the last")
        if self.stack and n > self.stack[-1][0]:
            raise ValueError("a chunk may not hold more leaves than the one before")
        self.stack.append((n, tree_root(leaves, self.threads)))
        self.size += n
        if n & (n - 1):
            self._last = True  # the remainder: its root folds in as it is
            return
        while len(self.stack) > 1 and self.stack[-1][0] == self.stack[-2][0]:
            (size, left), (_, right) = self.stack[-2], self.stack[-1]
            self.stack[-2:] = [(2 * size, hashlib.sha256(NODE_PREFIX + left + right).digest())]

    def root(self) -> bytes:
        """The root of everything added so far."""
        if not self.stack:
            return hashlib.sha256(b"").digest()
        r = self.stack[-1][1]
        for _, left in reversed(self.stack[:-1]):
            r = hashlib.sha256(NODE_PREFIX + left + r).digest()
        return r
