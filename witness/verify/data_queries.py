"""Answering data queries about a finished bundle: build the commitments, write the proofs."""

from __future__ import annotations

import os
from pathlib import Path

from ..bundle.reader import Bundle, open_bundle
from ..commit.hashing import same
from ..data.proofs import RunCommitments
from ..errors import MalformedInput
from ..task.base import Task
from .audit import check_usage, task_of


def run_commitments(bundle: Bundle | str | os.PathLike) -> tuple[RunCommitments, Task]:
    """A finished bundle (opened here if given as a path) with its used-data trees rebuilt locally."""
    if not isinstance(bundle, Bundle):
        bundle = open_bundle(bundle)
    if bundle.end is None:
        raise MalformedInput("data queries need a finished run (its end record commits the used data)")
    task = task_of(bundle)
    dataset = task.dataset()
    if not same(dataset.root, bundle.manifest.data_root):
        raise MalformedInput("this machine's dataset is not the one the run committed to")
    usage = check_usage(bundle, dataset)
    run = RunCommitments(bundle.manifest.public_key, bundle.final_head, bundle.log, bundle.end.raw,
                         [r.raw for r in bundle.steps], dataset, usage)
    return run, task


def query_document(task: Task, file: str | None, text: str | None) -> bytes:
    """The document hash a query names."""
    if (file is None) == (text is None):
        raise ValueError("name the document with exactly one of --file or --text")
    content = Path(file).read_bytes() if file is not None else text.encode()  # type: ignore[union-attr]
    return task.dataset().document_hash(content)
