"""Canonical sample bytes for common kinds of data: tensors, token windows, text.

A dataset is committed as a sequence of canonical byte strings (one Merkle leaf each), so the
sample a verifier rebuilds must be byte-identical to the one trained on. These codecs turn the
usual shapes of training data into such bytes and back into batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..data.dataset import Dataset
from ..data.locate import data_file
from ..data.tokens import Tokenizer, tokens_of_text

MAX_SAMPLE_BYTES = 16 * 1024 * 1024


class TensorSamples:
    """Samples that are named tensors, as safetensors bytes (no metadata, fixed layout)."""

    def encode(self, sample: dict[str, torch.Tensor]) -> bytes:
        """Canonical bytes of one sample: the same tensors always give the same bytes."""
        return save_tensors({k: sample[k].detach().contiguous().cpu() for k in sorted(sample)})

    def decode(self, data: bytes) -> dict[str, torch.Tensor]:
        """One sample's tensors."""
        if len(data) > MAX_SAMPLE_BYTES:
            raise ValueError("a sample is too large")
        return load_tensors(data)

    def collate(self, samples: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """A batch: every named tensor stacked along a new first dimension."""
        decoded = [self.decode(s) for s in samples]
        return {k: torch.stack([d[k] for d in decoded]) for k in decoded[0]}


class TextSamples:
    """Samples that are text, as UTF-8; a batch is the list of strings (tokenize in the model)."""

    def encode(self, sample: str) -> bytes:
        """UTF-8 bytes."""
        return sample.encode("utf-8")

    def decode(self, data: bytes) -> str:
        """The text."""
        return data.decode("utf-8")

    def collate(self, samples: Sequence[bytes]) -> list[str]:
        """The batch's texts, in order."""
        return [self.decode(s) for s in samples]


class TokenWindows(Dataset):
    """Windows of ``block + 1`` tokens from a flat token file (the ``uint16`` ``.bin`` format that
    nanoGPT and llm.c write), ``stride`` tokens apart; a sample's bytes are its tokens as
    little-endian ``uint16``. A batch is ``(x, y)``: inputs and next-token targets.

    ``source`` is a recipe's data name (a ``str``, found in the data folders by
    ``witness.data.locate.data_file`` when the tokens are first read, so a verifier that needs no
    data, or finds it elsewhere by its root, never opens it) or a ``Path`` (also opened when first
    read)."""

    name = "token-windows"

    def __init__(self, source: str | Path, block: int, stride: int | None = None, dtype: str = "<u2",
                 tokenize: Tokenizer | None = None):
        """``tokenize``: text to token ids, for ``--text`` data queries (``str.encode`` for bytes)."""
        self.source, self.block, self.tokenize = source, block, tokenize
        self.stride = stride or block
        self.dtype = np.dtype(dtype)
        self.unit = self.dtype.itemsize
        if block < 1 or self.stride < 1:
            raise ValueError("a window needs a block and a stride of at least one token")
        # the file is opened when a sample or the length is first asked for, never here: building one
        # reads no disk, so how its samples decode never depends on which files a machine holds

    @cached_property
    def path(self) -> Path:
        """The token file."""
        return self.source if isinstance(self.source, Path) else data_file(self.source)

    @cached_property
    def tokens(self) -> np.ndarray:
        """The file's tokens (memory-mapped)."""
        tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        if len(tokens) < self.block + 1:
            raise ValueError(f"{self.path} holds {len(tokens)} tokens: too few for a window of {self.block + 1}")
        return tokens

    def __len__(self) -> int:
        return (len(self.tokens) - self.block - 1) // self.stride + 1

    def sample_bytes(self, index: int) -> bytes:
        """The window's tokens, little-endian."""
        start = index * self.stride
        return self.tokens[start:start + self.block + 1].astype(self.dtype.newbyteorder("<")).tobytes()

    def text_bytes(self, text: str) -> bytes:
        """A text as this file's token bytes, by its tokenizer."""
        return tokens_of_text(text, self.tokenize, self.dtype)

    def collate(self, samples: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, ``[B, block]`` each, as int64."""
        arr = np.stack([np.frombuffer(s, dtype=self.dtype.newbyteorder("<")) for s in samples]).astype(np.int64)
        t = torch.from_numpy(arr)
        # contiguous copies: nanoGPT-style losses call targets.view(-1), which a slice refuses
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class CorpusWindows:
    """The codec of a ``TokenCorpus``'s packed windows (``witness.data.tokens``): each sample's 40
    bytes of document key (32) and stream offset (8) are stripped, and the batch is, as for
    ``TokenWindows``, ``(inputs, next-token targets)``, ``[B, block]`` each as int64. A generic task
    whose dataset is a ``TokenCorpus`` collates with it (no plugin strips the prefix itself)."""

    PREFIX = 40

    def __init__(self, dtype: str | np.dtype = "<u2"):
        self.dtype = np.dtype(dtype).newbyteorder("<")

    def collate(self, samples: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the windows' tokens."""
        arr = np.stack([np.frombuffer(s[self.PREFIX:], dtype=self.dtype) for s in samples]).astype(np.int64)
        t = torch.from_numpy(arr)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class SampleList(Dataset):
    """A dataset given as its canonical samples, in order."""

    def __init__(self, samples: Sequence[bytes], name: str = "samples"):
        self.samples, self.name = list(samples), name

    def __len__(self) -> int:
        return len(self.samples)

    def sample_bytes(self, index: int) -> bytes:
        """Sample ``index``'s bytes."""
        return self.samples[index]
