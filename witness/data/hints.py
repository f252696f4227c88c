"""Hints for a data query whose input plainly does not fit the kind of data the run trained on.

A hint never changes an answer: ``witness data include|exclude|find`` answer for the bytes they
were given, exactly as before, and print a hint beside a "never used" or "nothing found" answer
only. The hint says which flag names such an input (``--text`` for a text on a dataset of
tokens, ``--file`` for a dataset of tensors), because the tools read ``--file`` as the dataset's
own bytes (token ids, a sample's safetensors bytes) and ``--text`` as a text.
"""

from __future__ import annotations

import json
import re

from .dataset import Dataset

# What a file is read for: enough to tell text from token ids (a text's first MiB is text).
PEEK_BYTES = 1 << 20
# Control bytes no text file holds (tab, newline, vertical tab, form feed and return are allowed).
_CONTROL = re.compile(rb"[\x00-\x08\x0e-\x1f\x7f]")


def looks_like_text(content: bytes) -> bool:
    """Whether bytes read plainly as a text: UTF-8 (a character cut at the end of a peek allowed)
    with no NUL or other control byte."""
    if not content or _CONTROL.search(content):
        return False
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as e:
        # only a character cut by the peek at PEEK_BYTES is forgiven, never a bad byte inside
        return len(content) >= PEEK_BYTES and e.start >= len(content) - 3 and e.reason == "unexpected end of data"
    return True


def holds_tokens(dataset: Dataset) -> bool:
    """Whether the dataset's documents are token ids of more than one byte (a token corpus or
    token windows): then a document's bytes are its ids, little-endian, never its text."""
    return dataset.unit > 1


def holds_tensors(dataset: Dataset) -> bool:
    """Whether every document of the dataset is one sample's safetensors bytes: rule ``self``
    (a sample is its own document) and a first sample that parses as a safetensors header."""
    if dataset.DOCUMENT_RULE != "self" or len(dataset) == 0:
        return False
    first = dataset.sample_bytes(0)
    n = int.from_bytes(first[:8], "little") if len(first) >= 10 else 0
    if not 2 <= n <= len(first) - 8 or first[8:9] != b"{":
        return False
    try:
        return isinstance(json.loads(first[8:8 + n]), dict)
    except ValueError:
        return False


def file_hint(dataset: Dataset, file: str, peek: bytes) -> str | None:
    """The hint for ``--file FILE`` (``peek``: its first bytes) that reads as text on a dataset of
    tokens, or None where the file may well be what ``--file`` takes.

    How it decides: a token file holds ids of 2 or 4 bytes, little-endian. Every id below 256 has
    a NUL high byte (2-byte ids: bytes, punctuation and newlines in GPT-2's vocabulary, in every
    real document), and every 4-byte id below 2**24 (any vocabulary) has one, so a file of such
    ids that is NUL-free UTF-8 without control bytes is not what ``--file`` takes here: it is a
    text. The hint is only a hint: the answer for the bytes as token ids stands beside it.
    """
    if not holds_tokens(dataset) or not looks_like_text(peek):
        return None
    hint = (f"hint: {file} reads as text, but a document of this run's dataset is a file of its token ids "
            f"({dataset.unit}-byte, little-endian), so --file read these bytes as token ids; ")
    if getattr(dataset, "tokenize", None) is not None:
        return hint + ("to ask about the text, give it with --text (the dataset's tokenizer turns it into "
                       "tokens; every character counts, a final newline too)")
    return hint + ("--text takes a text, but this dataset has no tokenizer (tokenize=…): give --file the "
                   "text's token ids instead")


def text_hint(dataset: Dataset) -> str | None:
    """The hint for ``--text`` on a dataset whose every document is a sample's safetensors bytes
    (which no text is: its first 8 bytes are a length, with NUL bytes no command line holds), or None."""
    if not holds_tensors(dataset):
        return None
    return ("hint: a document of this run's dataset is one sample's tensors as safetensors bytes, which no text "
            "is: name a sample with --file (the file of its canonical bytes, as the task's samples codec encodes it)")
