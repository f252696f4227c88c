"""Token corpora as pretraining publishes them, committed as one dataset (no torch).

Reads the shard format of llm.c and modded-nanogpt (a header of 256 little-endian int32: magic
20240520 for uint16 tokens or 20240801 for uint32, a version, the token count; then the tokens)
and nanoGPT's headerless ``uint16`` ``.bin``. A corpus is one or more shards (a directory of
them, in name order), read as one stream of tokens.

**Documents** are the runs of tokens between end-of-text tokens (GPT-2's 50256 by default); the
end-of-text tokens themselves belong to none. A document's hash is the tagged SHA-256 of its
tokens, little-endian in the corpus's width, so ``witness data include --file doc.bin`` names one
by a file of its tokens.

**Samples** are packed windows, as llm.c and nanoGPT train on them: sample ``i`` is the
``block + 1`` tokens from stream offset ``i * block`` (inputs and their next-token targets), and
may span several documents. Its canonical bytes are ``document key (32) ‖ offset (8, big-endian)
‖ tokens (little-endian)`` (document rule ``prefix32``), where the key names the list of documents
the window touches (``leaves.documents_key``).

Committing streams the corpus in chunks (``commit``): memory stays bounded whatever its size,
and the hashing runs natively on every core (``commit/batch.py``).
"""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..commit.batch import StreamingRoot, tagged_many, tagged_windows
from ..commit.hashing import tagged_hash
from .dataset import SAMPLE_TAG, Dataset
from .leaves import (
    HEADER,
    MAGIC,
    RULES,
    DatasetLeaves,
    document_keys,
    read_leaves,
)

LLMC_HEADER_INTS = 256
LLMC_MAGIC = {20240520: np.dtype("<u2"), 20240801: np.dtype("<u4")}
GPT2_EOT = 50256
DOCUMENT_TAGS = {2: "witness/tokens-u16/v1", 4: "witness/tokens-u32/v1"}
# How much of the corpus a commit holds at once (tokens of a batch of documents or windows).
STREAM_BYTES = 64 << 20


LLMC_VERSION = {20240520: 1, 20240801: 7}  # llm.c's header version beside each magic


def open_shard(path: str | os.PathLike, fmt: str = "auto") -> np.ndarray:
    """The tokens of one shard, memory-mapped: ``fmt`` is ``llmc`` (the 256-int32 header),
    ``u16`` (nanoGPT's headerless file), ``u32``, or ``auto``: ``llmc`` where the file starts with
    llm.c's magic, or with an llm.c-shaped header (the 253 ints after magic, version and count all
    0: no token stream starts so), else ``u16``. An llm.c header is validated whole (magic, version,
    a token count that fits the file's size): a damaged one is an error, never read as tokens."""
    path = Path(path)
    size = path.stat().st_size
    if fmt in ("auto", "llmc"):
        header = np.fromfile(path, "<i4", LLMC_HEADER_INTS) if size >= 4 * LLMC_HEADER_INTS else None
        dtype = LLMC_MAGIC.get(int(header[0])) if header is not None else None
        shaped = header is not None and not header[3:].any()
        if dtype is not None or shaped or fmt == "llmc":
            problem = _llmc_problem(header, size)
            if problem and (dtype is not None or shaped):
                raise ValueError(f"{path} has an llm.c shard header, but {problem}: the shard is damaged or not "
                                 "llm.c's (--format u16 or u32 reads a headerless file)")
            if problem:
                raise ValueError(f"{path} is not an llm.c token shard: {problem}")
            return np.memmap(path, dtype, "r", 4 * LLMC_HEADER_INTS, (int(header[2]),))
        fmt = "u16"
    widths = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}
    if fmt not in widths:
        raise ValueError("a shard's format is auto, llmc, u16 or u32")
    if size % widths[fmt].itemsize:
        raise ValueError(f"{path} is not a whole number of {fmt} tokens")
    return np.memmap(path, widths[fmt], "r", 0, (size // widths[fmt].itemsize,))


def _llmc_problem(header: np.ndarray | None, size: int) -> str | None:
    """What is wrong with an llm.c shard's header, or None."""
    if header is None:
        return f"{size} bytes, shorter than its {4 * LLMC_HEADER_INTS}-byte header"
    magic, version, count = (int(x) for x in header[:3])
    dtype = LLMC_MAGIC.get(magic)
    if dtype is None:
        return f"its magic is {magic}, not llm.c's 20240520 (uint16 tokens) or 20240801 (uint32)"
    if version != LLMC_VERSION[magic]:
        return f"its version is {version}; magic {magic} goes with version {LLMC_VERSION[magic]}"
    held = (size - 4 * LLMC_HEADER_INTS) / dtype.itemsize
    if count < 0 or count != held:
        return f"it counts {count} tokens and the file holds {held:g}"
    return None


def shard_format(shard: np.ndarray) -> str:
    """How a shard ``open_shard`` opened was read: ``llmc-u16``, ``llmc-u32``, ``u16`` or ``u32``."""
    width = f"u{8 * shard.dtype.itemsize}"
    return f"llmc-{width}" if getattr(shard, "offset", 0) == 4 * LLMC_HEADER_INTS else width


def write_llmc_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens as an llm.c shard (uint16 tokens get magic 20240520, uint32 ones 20240801)."""
    dtype = np.dtype(tokens.dtype).newbyteorder("<")
    magic = {2: 20240520, 4: 20240801}[dtype.itemsize]
    header = np.zeros(LLMC_HEADER_INTS, "<i4")
    header[:3] = (magic, 1 if dtype.itemsize == 2 else 7, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype).tobytes())


def shard_paths(source: str | os.PathLike) -> list[Path]:
    """A shard, or every ``.bin`` file of a directory in name order."""
    p = Path(source)
    paths = sorted(q for q in p.iterdir() if q.suffix == ".bin" and q.is_file()) if p.is_dir() else [p]
    if not paths:
        raise ValueError(f"{p} holds no .bin token shards")
    return paths


Tokenizer = Callable[[str], Sequence[int]]


def byte_tokens(text: str) -> bytes:
    """A byte-level vocabulary's tokenizer: token i is byte i of the text's UTF-8."""
    return text.encode("utf-8")


def tokens_of_text(text: str, tokenize: Tokenizer | None, dtype: np.dtype) -> bytes:
    """A text's tokens, little-endian in ``dtype``'s width (what a ``--text`` query names)."""
    if tokenize is None:
        raise ValueError("the dataset holds tokens and was given no tokenizer: name the text by its tokens "
                         "(--file with the tokens, little-endian), or give the dataset tokenize=…")
    ids = np.asarray(list(tokenize(text)), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << (8 * np.dtype(dtype).itemsize)):
        raise ValueError("the tokenizer gave ids outside the dataset's token width")
    return ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes()


class TokenCorpus(Dataset):
    """Packed windows of ``block + 1`` tokens over a corpus of shards (see the module docstring)."""

    name = "token-corpus"
    DOCUMENT_RULE = "prefix32"

    def __init__(self, source: str | os.PathLike, block: int, *, eot: int = GPT2_EOT, fmt: str = "auto",
                 leaves_path: str | os.PathLike | None = None, tokenize: Tokenizer | None = None):
        """``leaves_path``: a leaves file to read the commitment from (written by ``commit``);
        ``tokenize``: text to token ids, for ``--text`` queries (``byte_tokens`` for a byte vocabulary)."""
        self.tokenize = tokenize
        self.paths = shard_paths(source)
        self.shards = [open_shard(p, fmt) for p in self.paths]
        widths = {s.dtype.itemsize for s in self.shards}
        if len(widths) != 1:
            raise ValueError("the shards mix 16- and 32-bit tokens")
        self.width = self.unit = widths.pop()
        self.dtype = self.shards[0].dtype
        if not 0 <= eot < 1 << (8 * self.width):
            raise ValueError(f"the end-of-text token {eot} is not a {8 * self.width}-bit token id "
                             f"(0 to {(1 << (8 * self.width)) - 1})")
        self.block, self.eot = block, eot
        self.starts = np.concatenate([[0], np.cumsum([len(s) for s in self.shards])]).astype(np.int64)
        self.tokens_total = int(self.starts[-1])
        if block < 1 or self.tokens_total < block + 1:
            raise ValueError(f"the corpus holds {self.tokens_total} tokens: too few for a window of {block + 1}")
        self.leaves_path = Path(leaves_path) if leaves_path else None

    def __len__(self) -> int:
        return (self.tokens_total - 1) // self.block

    # --- the token stream ---------------------------------------------------------------
    def tokens(self, lo: int, hi: int) -> np.ndarray:
        """Stream tokens ``lo`` to ``hi`` (across shards)."""
        lo, hi = max(0, lo), min(hi, self.tokens_total)
        parts = []
        for k in range(int(np.searchsorted(self.starts, lo, "right")) - 1, len(self.shards)):
            s0 = int(self.starts[k])
            if s0 >= hi:
                break
            parts.append(self.shards[k][max(lo - s0, 0):hi - s0])
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def document_hash(self, content: bytes) -> bytes:
        """Hash of a document given as its tokens (little-endian, the corpus's width)."""
        if len(content) % self.width:
            raise ValueError(f"a document of this corpus is a whole number of {self.width}-byte tokens")
        return tagged_hash(DOCUMENT_TAGS[self.width], content)

    def text_bytes(self, text: str) -> bytes:
        """A text as this corpus's token bytes, by its tokenizer."""
        return tokens_of_text(text, self.tokenize, self.dtype)

    # --- samples ------------------------------------------------------------------------
    def sample_bytes(self, index: int) -> bytes:
        """Window ``index``: its document key, its stream offset, its tokens."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.block
        return self.leaves.key(index) + start.to_bytes(8, "big") + self.tokens(start, start + self.block + 1).tobytes()

    def sample_documents(self, index: int, canonical: bytes) -> list[bytes]:
        """The documents window ``index`` touches."""
        return self.leaves.documents(index)

    def batch_root(self, indices) -> bytes:  # noqa: ANN001 - any sequence of ints
        """Batch root from the committed hashes (never the whole hash list as Python objects)."""
        return self.leaves.batch_root(indices)

    def sample_hash(self, index: int) -> bytes:
        """Hash of window ``index``."""
        return self.leaves.sample_hash(index)

    @cached_property
    def leaves(self) -> DatasetLeaves:
        """The commitment's columns: read from ``leaves_path`` when given, else committed now."""
        if self.leaves_path is not None and self.leaves_path.exists():
            return read_leaves(self.leaves_path, samples=len(self), rule=self.DOCUMENT_RULE)[0]
        path = self.leaves_path
        if path is None:
            fd, name = tempfile.mkstemp(suffix=".leaves")
            os.close(fd)
            path = Path(name)
        try:
            self.commit(path)
            leaves = read_leaves(path, samples=len(self), rule=self.DOCUMENT_RULE)[0]
            if self.leaves_path is None:  # keep the arrays, drop the temporary file
                leaves = DatasetLeaves(leaves.rule, np.array(leaves.hashes), np.array(leaves.first),
                                       np.array(leaves.count), np.array(leaves.table))
        finally:
            if self.leaves_path is None:
                path.unlink(missing_ok=True)
        return leaves

    @cached_property
    def root(self) -> bytes:
        """The dataset commitment."""
        if self.leaves_path is not None and self.leaves_path.exists():
            return read_leaves(self.leaves_path, samples=len(self), rule=self.DOCUMENT_RULE)[1]
        return self.leaves.root()

    def documents_list(self) -> list[tuple[str, bytes, bytes]]:
        """Every document: (where it starts in the stream, its hash, its tokens' bytes)."""
        return [(f"tokens {lo}:{hi}", self.document_hash(t.tobytes()), t.tobytes())
                for lo, hi, t in self._documents(0, self.tokens_total)]

    def _documents(self, lo: int, hi: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """Documents that start in ``[lo, hi)``: (start, end, tokens)."""
        span = self.tokens(lo, hi)
        ends = np.flatnonzero(span == self.eot)
        bounds = np.concatenate([[-1], ends, [len(span)]])
        for a, b in zip(bounds[:-1] + 1, bounds[1:], strict=True):
            if b > a:
                yield lo + int(a), lo + int(b), span[a:b]

    # --- committing, in bounded memory --------------------------------------------------
    def _document_batches(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
        """Every document, in stream order, as batches ``(starts, ends, hashes, covered)``: a
        batch holds every document that starts before ``covered`` and after the last batch's.

        A batch reads at most ``STREAM_BYTES`` of tokens and ends after its last end-of-text
        token, so the document still open there starts the next batch; one longer than a batch
        is hashed piece by piece.
        """
        step = max(1, STREAM_BYTES // self.width)
        tag = DOCUMENT_TAGS[self.width]
        pos = 0
        while pos < self.tokens_total:
            hi = min(self.tokens_total, pos + step)
            span = self.tokens(pos, hi)
            eots = np.flatnonzero(span == self.eot)
            if hi < self.tokens_total:
                if not len(eots):  # a document longer than a batch
                    end = self._next_eot(hi)
                    yield (np.array([pos]), np.array([end]), self._long_document(pos, end, tag), end + 1)
                    pos = end + 1
                    continue
                span = span[:eots[-1] + 1]  # the document open here starts the next batch
                hi = pos + len(span)
            bounds = np.concatenate([[-1], eots, [len(span)]])
            starts, ends = bounds[:-1] + 1, bounds[1:]
            keep = ends > starts
            starts, ends = starts[keep], ends[keep]
            spans = np.empty(2 * len(starts), "<u8")
            spans[0::2], spans[1::2] = starts * self.width, ends * self.width
            raw = np.ascontiguousarray(span).view(np.uint8)
            hashes = np.frombuffer(tagged_many(tag, raw, spans, spans=True), np.uint8).reshape(-1, 32)
            yield starts.astype(np.int64) + pos, ends.astype(np.int64) + pos, hashes, hi
            pos = hi

    def _next_eot(self, at: int) -> int:
        """Where the document open at ``at`` ends: the next end-of-text token, or the stream's end."""
        while at < self.tokens_total:
            span = self.tokens(at, at + max(1, STREAM_BYTES // self.width))
            hit = np.flatnonzero(span == self.eot)
            if len(hit):
                return at + int(hit[0])
            at += len(span)
        return self.tokens_total

    def _long_document(self, lo: int, hi: int, tag: str) -> np.ndarray:
        """The hash of a document too long for one batch, read piece by piece."""
        h = hashlib.sha256(tag.encode() + b"\x00" + ((hi - lo) * self.width).to_bytes(8, "big"))
        step = max(1, STREAM_BYTES // self.width)
        for at in range(lo, hi, step):
            h.update(np.ascontiguousarray(self.tokens(at, min(hi, at + step))).view(np.uint8))
        return np.frombuffer(h.digest(), np.uint8).reshape(1, 32)

    def commit(self, path: str | os.PathLike, progress: bool = False) -> bytes:
        """Hash every document and window, write the leaves file to ``path``, return the root.

        One pass in stream order: documents are hashed batch by batch just ahead of the windows
        that touch them (which the page cache then serves), and only the documents still open at
        the current windows are held. Memory stays a few hundred MB whatever the corpus's size.
        """
        n, L = len(self), self.block + 1
        if L > 2 * 65535:
            raise ValueError("a window this long could touch more documents than the leaves file counts")
        chunk = 1 << max(0, (STREAM_BYTES // (L * self.width)).bit_length() - 1)  # a power of two (StreamingRoot)
        path = Path(path)
        # a scratch file of its own (O_EXCL): never a name that could be a link to, or be, an input
        fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".table")
        table_tmp = Path(scratch)
        batches = _ahead(self._document_batches())  # the next documents hash while these windows do
        # the documents the current windows may touch: starts, ends, hashes, and the global
        # index of the first of them (their place in the document table)
        starts = ends = np.zeros(0, np.int64)
        hashes = np.zeros((0, 32), np.uint8)
        base = covered = 0
        acc = StreamingRoot()
        bar = tqdm(total=n, desc="committing the corpus", unit="window", unit_scale=True, disable=not progress)
        with bar, open(path, "wb") as f, os.fdopen(fd, "wb") as table:
            f.write(HEADER.pack(MAGIC, n, 0, RULES.index("prefix32"), bytes(32)))
            f.truncate(HEADER.size + 40 * n + 2 * n + (-(2 * n) % 8))
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                a, b = lo * self.block, (hi - 1) * self.block + L
                while covered < b:  # every document that starts inside these windows is known
                    s, e, h, covered = next(batches)
                    table.write(h.tobytes())
                    starts, ends, hashes = np.concatenate([starts, s]), np.concatenate([ends, e]), np.concatenate([hashes, h])
                gone = int(np.searchsorted(ends, a, "right"))  # documents over before these windows
                starts, ends, hashes, base = starts[gone:], ends[gone:], hashes[gone:], base + gone
                w0 = np.arange(lo, hi, dtype=np.int64) * self.block
                first = np.searchsorted(ends, w0, "right")  # the first document still open at the window
                count = np.searchsorted(starts, w0 + L, "left") - first
                keys = document_keys(first, count, hashes)
                span = np.ascontiguousarray(self.tokens(a, b))  # a memory map's pages, or one copy across shards
                both = np.frombuffer(tagged_windows(SAMPLE_TAG, keys, span, a, self.block, self.width,
                                                    L * self.width), np.uint8).reshape(-1, 64)
                sample = both[:, :32]
                acc.add(np.ascontiguousarray(both[:, 32:]))  # the windows' leaves of the dataset tree
                f.seek(HEADER.size + 32 * lo)
                f.write(sample.tobytes())
                f.seek(HEADER.size + 32 * n + 8 * lo)
                f.write((first + base).astype("<u8").tobytes())
                f.seek(HEADER.size + 40 * n + 2 * lo)
                f.write(count.astype("<u2").tobytes())
                bar.update(hi - lo)
            # the table ends with the last document a window touches (any read beyond is dropped)
            m = base + int(np.searchsorted(starts, (n - 1) * self.block + L, "left"))
            table.truncate(32 * m)
            root = acc.root()
            f.seek(0)
            f.write(HEADER.pack(MAGIC, n, m, RULES.index("prefix32"), root))
            f.seek(0, os.SEEK_END)
            table.flush()
            with open(table_tmp, "rb") as t:
                while piece := t.read(1 << 24):
                    f.write(piece)
        batches.close()  # the producer thread, if it ran ahead of the last windows
        table_tmp.unlink()
        return root


def _ahead(items: Iterator, depth: int = 2) -> Iterator:
    """``items``, produced in a thread of their own up to ``depth`` ahead of the consumer (their
    numpy and hashing work release the GIL, so the two overlap on the cores); an error in the
    producer is raised in the consumer."""
    done = object()
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)
            return
        q.put(done)

    thread = threading.Thread(target=produce, name="witness-documents", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
