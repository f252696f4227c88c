"""The data-usage checks every mode makes in full: the task's document rule, every batch root, and
the used-sample and used-document trees, rebuilt from the dataset's committed leaves.

The leaves (``data/leaves.py``) come from the verifier's own copy of the dataset (offline) or from
a leaves file (the bundle's ``dataset.leaves`` or ``--leaves``), which must hash to the manifest's
data root. Either way the checks are hashing only: no raw data and no replay. What they leave to
replay is a step whose record names the right batch but that trained on other data.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..bundle.reader import Bundle
from ..commit.hashing import same
from ..data.dataset import Dataset
from ..data.leaves import DatasetLeaves, read_leaves
from ..data.usage import UsageCommitment, used_roots
from ..errors import MalformedInput, VerificationError
from ..task.base import Task


def check_document_rule(claimed: str, task: Task, what: str) -> None:
    """Raise unless ``claimed`` (a run's, a proof's) is the document rule the task decides."""
    if claimed != task.document_rule:
        raise VerificationError(f"{what} gives documents under rule {claimed!r}, but the task {task.name!r} "
                                f"decides rule {task.document_rule!r}: the task, never the run, says what a "
                                "document is", check="data usage")


def committed_leaves(bundle: Bundle, task: Task, dataset: Dataset | None = None,
                     leaves_path: str | os.PathLike | None = None) -> DatasetLeaves | None:
    """The dataset's committed leaves: the local dataset's (its root already matched), or a leaves
    file checked against the manifest's data root; None for a run before they were committed."""
    m = bundle.manifest
    if m.data_commitment < 2:
        return None
    path = Path(leaves_path) if leaves_path is not None else bundle.leaves
    if dataset is not None:
        if path is not None:  # the bundle carries a file too: it must be the same commitment
            _checked_file(bundle, task, path)
        return dataset.leaves
    if path is None:
        raise MalformedInput("this audit needs the dataset's leaves (the per-sample commitments): the bundle "
                             "has no dataset.leaves; pass --leaves FILE, or verify offline with the dataset")
    if not path.is_file() or path.is_symlink():
        raise MalformedInput(f"{path} is not a leaves file")
    return _checked_file(bundle, task, path)


def _checked_file(bundle: Bundle, task: Task, path: Path) -> DatasetLeaves:
    """A leaves file read and checked against the manifest's data root, once per bundle and file."""
    key = (path.resolve(), task.document_rule)
    if key not in bundle.checked_leaves:
        m = bundle.manifest
        leaves, _ = read_leaves(path, samples=m.dataset_size, rule=task.document_rule)
        leaves.check_root(m.data_root)
        bundle.checked_leaves[key] = leaves
    return bundle.checked_leaves[key]


def check_batch_roots(bundle: Bundle, batch_root) -> None:  # noqa: ANN001 - indices -> root
    """Every step's batch root must be that of the committed samples at its batch's indices."""
    for rec in bundle.steps:
        if not same(batch_root(rec.batch), rec.batch_root):
            raise VerificationError("the batch root is not that of the committed samples at the batch's "
                                    "indices", step=rec.step, check="data")


def check_used_trees(bundle: Bundle, committed: dict) -> None:
    """The end record's used-sample and used-document trees must be the ones ``committed`` gives."""
    end = bundle.end
    if end is None:
        return
    for name, claimed in (("sample", end.used_samples), ("document", end.used_documents)):
        want = committed[f"used_{name}s"]
        if claimed.size != want["size"] or claimed.root.hex() != want["root"]:
            more = "adds data the run never trained on" if claimed.size > want["size"] else \
                "leaves out data the run trained on" if claimed.size < want["size"] else "is another set"
            raise VerificationError(f"the committed used-{name} tree is not the one the logged batches give "
                                    f"({claimed.size} committed, {want['size']} used): it {more}",
                                    check="data usage")


def check_data_usage(bundle: Bundle, task: Task, leaves: DatasetLeaves | None,
                     dataset: Dataset | None = None) -> list[str]:
    """Every check of the run's data commitments that needs no replay; the lines for the verdict."""
    n = len(bundle.steps)
    if bundle.end is not None:
        check_document_rule(bundle.end.document_rule, task, "the end record")
    if leaves is None and dataset is None:  # an interactive audit of a run before the leaves existed
        return []
    check_batch_roots(bundle, leaves.batch_root if leaves is not None else dataset.batch_root)  # type: ignore[union-attr]
    source = "the dataset's committed leaves" if leaves is not None else "the dataset"
    checks = [f"batch roots of all {n} steps recomputed from {source}"]
    if bundle.end is not None:
        if leaves is not None:
            committed = used_roots(leaves, (r.batch for r in bundle.steps))
        else:  # a run before the leaves: its trees from the local dataset, as it committed them
            committed = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps)).to_json()  # type: ignore[arg-type]
        check_used_trees(bundle, committed)
        checks.append(f"used-sample and used-document trees rebuilt from all {n} batches ({source}, "
                      f"rule {task.document_rule!r})")
    return checks
