"""Answering data queries about a finished bundle: build the commitments, write the proofs."""

from __future__ import annotations

import os
from pathlib import Path

from ..bundle.reader import open_bundle
from ..commit.hashing import same
from ..data.proofs import RunCommitments
from ..data.usage import UsageCommitment
from ..errors import MalformedInput, VerificationError
from ..task.base import Task
from .audit import task_of


def run_commitments(bundle_dir: str | os.PathLike) -> tuple[RunCommitments, Task]:
    """Open a finished bundle and rebuild its used-data trees from the local dataset."""
    bundle = open_bundle(bundle_dir)
    if bundle.end is None:
        raise MalformedInput("data queries need a finished run (its end record commits the used data)")
    task = task_of(bundle)
    dataset = task.dataset()
    if not same(dataset.root, bundle.manifest.data_root):
        raise MalformedInput("this machine's dataset is not the one the run committed to")
    usage = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps))
    end = bundle.end
    if usage.documents.size != end.used_documents.size or not same(usage.documents.root, end.used_documents.root):
        raise VerificationError("the run's used-document commitment is not the one its batches give", check="data usage")
    run = RunCommitments(bundle.manifest.public_key, bundle.final_head, bundle.log, end.raw,
                         [r.raw for r in bundle.steps], dataset, usage)
    return run, task


def query_document(task: Task, file: str | None, text: str | None) -> bytes:
    """The document hash a query names."""
    if (file is None) == (text is None):
        raise ValueError("name the document with exactly one of --file or --text")
    content = Path(file).read_bytes() if file is not None else text.encode()  # type: ignore[union-attr]
    return task.dataset().document_hash(content)
