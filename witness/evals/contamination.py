"""Contamination: exact absence proofs of every evaluation document, and (for information only)
near-duplicate overlap between evaluation and training documents."""

from __future__ import annotations

import hashlib

from ..commit.sorted_tree import SortedTree
from ..errors import VerificationError

NGRAM = 64


def _anchored_ngrams(data: bytes, n: int = NGRAM) -> set[bytes]:
    """Digests of the n-grams that start a line: a sparse, deterministic sample of the text."""
    out = set()
    start = 0
    while start + n <= len(data):
        out.add(hashlib.blake2b(data[start : start + n], digest_size=12).digest())
        nxt = data.find(b"\n", start)
        if nxt < 0:
            break
        start = nxt + 1
    return out


def near_duplicates(eval_docs: list[tuple[str, bytes]], train_docs: list[bytes], n: int = NGRAM) -> dict:
    """Long n-grams (at line starts) that evaluation documents share with used training documents."""
    train: set[bytes] = set()
    for data in train_docs:
        train |= _anchored_ngrams(data, n)
    flagged = []
    total = shared = 0
    for name, data in eval_docs:
        grams = _anchored_ngrams(data, n)
        common = len(grams & train)
        total += len(grams)
        shared += common
        if grams and common / len(grams) >= 0.5:
            flagged.append({"document": name, "shared_fraction": round(common / len(grams), 4)})
    return {
        "ngram_bytes": n,
        "eval_ngrams": total,
        "shared_ngrams": shared,
        "shared_fraction": shared / total if total else 0.0,
        "documents_mostly_shared": flagged,
        "note": "informational only: not part of the exact contamination claim",
    }


def contaminated(eval_docs: list[tuple[str, bytes]], used: SortedTree) -> list[str]:
    """Names of evaluation documents (name, hash) that the run trained on."""
    return [name for name, h in eval_docs if h in used]


def absence_proofs(eval_docs: list[tuple[str, bytes, bytes]], used: SortedTree,
                   train_docs: list[tuple[str, bytes, bytes]]) -> tuple[list, dict]:
    """Every evaluation document (name, hash, bytes) proven absent from the run's used-document tree, and
    the near duplicates among the training documents it used; ``VerificationError`` naming one it trained
    on. (absences, near duplicates)."""
    dirty = contaminated([(n, h) for n, h, _ in eval_docs], used)
    if dirty:
        raise VerificationError(f"the run trained on {len(dirty)} evaluation document(s), e.g. {dirty[0]!r}; "
                                "no clean certificate exists", check="contamination")
    trained = [data for _, h, data in train_docs if h in used]
    return [(n, h, used.prove_absent(h)) for n, h, _ in eval_docs], \
        near_duplicates([(n, data) for n, _, data in eval_docs], trained)
