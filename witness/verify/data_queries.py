"""Answering data queries about a finished bundle: build the commitments, write and check the proofs."""

from __future__ import annotations

import os
from typing import Any

from ..bundle.reader import Bundle, open_bundle
from ..commit.hashing import same
from ..commit.signing import SignedTreeHead
from ..data.dataset import Dataset
from ..data.proofs import RunCommitments, check_proof
from ..data.usage import UsageCommitment
from ..errors import MalformedInput
from ..task.base import Task
from ..task.registry import task_class
from .audit import task_of
from .finddata import committed_dataset
from .usage import check_data_usage, committed_leaves


def run_commitments(bundle: Bundle | str | os.PathLike, notes: list[str] | None = None) -> tuple[RunCommitments, Task]:
    """A finished bundle (opened here if given as a path) with its used-data trees rebuilt locally
    and checked against the end record (under the task's document rule); ``notes`` gets where the
    committed dataset was found, if not where the recipe's names point."""
    if not isinstance(bundle, Bundle):
        bundle = open_bundle(bundle)
    if bundle.end is None:
        raise MalformedInput("data queries need a finished run (its end record commits the used data)")
    task = task_of(bundle)
    m = bundle.manifest
    dataset, found = committed_dataset(task, m)
    if found is not None and notes is not None:
        notes.append(found)
    check_data_usage(bundle, task, committed_leaves(bundle, task, dataset), dataset)
    usage = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps))
    run = RunCommitments(m.public_key, bundle.final_head, bundle.log, bundle.end.raw,
                         [r.raw for r in bundle.steps], dataset, usage)
    return run, task


def task_rule(name: str) -> str:
    """The document rule of the registered task ``name`` (unusable input where it is not installed)."""
    try:
        return task_class(name).document_rule
    except (ValueError, ImportError) as e:
        raise MalformedInput(f"the proof's run is of task {name!r}, which cannot be built here: {e}") from None


def check_data_proof(proof: Any, *, head: SignedTreeHead | None = None, public_key: str | None = None,
                     task: Task | None = None) -> dict:
    """Check a data proof under the document rule of its run's task: ``task`` (a bundle's), or the
    registered task that the run's final head names."""
    return check_proof(proof, document_rule=task.document_rule if task is not None else task_rule,
                       head=head, public_key=public_key)


MAX_DOCUMENT_BYTES = 256 << 20  # a document a proof names (a device or a corpus is refused)


def query_document(dataset: Dataset, file: str | None, text: str | None) -> bytes:
    """The document hash a query names."""
    if (file is None) == (text is None):
        raise ValueError("name the document with exactly one of --file or --text")
    if file is not None:
        with open(file, "rb") as f:  # a document: bounded (a device or a huge file is refused, not read whole)
            content = f.read(MAX_DOCUMENT_BYTES + 1)
        if len(content) > MAX_DOCUMENT_BYTES:
            raise ValueError(f"--file {file}: over {MAX_DOCUMENT_BYTES} bytes, larger than any document a proof names")
    else:
        content = dataset.text_bytes(text)  # type: ignore[arg-type]
    return dataset.document_hash(content)


def known_document(run: RunCommitments, document: bytes) -> bool:
    """Whether ``document`` is one of the committed dataset's documents (used or not)."""
    return any(same(h, document) for _, h, _ in run.dataset.documents_list())


def search_text(run: RunCommitments, needle: bytes, limit: int = 100) -> dict:
    """The documents and samples of the committed dataset whose bytes contain ``needle``, each with
    whether the run trained on it: the answer to "was this text used?", which a document proof
    (about one whole document) is not."""
    if not needle:
        raise ValueError("search for at least one byte")
    used = {i for rec in run.steps for i in rec["batch"]}
    docs = [{"document": name, "hash": h.hex(), "used": h in run.usage.documents}
            for name, h, content in run.dataset.documents_list() if run.dataset.contains(content, needle)]
    samples = []
    for i in range(len(run.dataset)):
        if run.dataset.contains(run.dataset.sample_bytes(i), needle):
            samples.append({"index": i, "used": i in used})
    return {"needle_bytes": len(needle), "documents": docs[:limit], "documents_found": len(docs),
            "documents_used": sum(d["used"] for d in docs), "samples": samples[:limit],
            "samples_found": len(samples), "samples_used": sum(s["used"] for s in samples)}
