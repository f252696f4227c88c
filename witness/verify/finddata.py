"""The offline audit's training data, found by its committed root wherever it lies here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..bundle.schema import Manifest
from ..commit.hashing import same
from ..data.dataset import Dataset
from ..data.locate import asked, by_content, candidates, on_search_path, pinned, search_path
from ..errors import MalformedInput
from ..task.base import Task


def _same_file(path: Path, named: Path | None) -> bool:
    return named is not None and path.resolve() == named.resolve()


@contextmanager
def run_files(m: Manifest) -> Iterator[dict[str, Path]]:
    """Within the block, each small file and folder the run's task read (``data_files``: a list of
    texts, a tokenizer) stands for the one here with its content, whatever its name (``by_content``);
    the dict yielded fills with what was found where."""
    with by_content(m.raw.get("data_files") or {}) as found:
        yield found


def found_notes(found: dict[str, Path]) -> list[str]:
    """Where each file found by its content lies, where that is not where its name points."""
    return [f"the data file {name!r} is {path} (found by its content)" for name, path in found.items()
            if not _same_file(path, on_search_path(name))]


def committed_dataset(task: Task, m: Manifest) -> tuple[Dataset, str | None]:
    """The dataset whose root the manifest commits, and a note where it was not where the recipe's
    names point: the task's own first, then every file of the data search path that could be it
    (a sample count unlike the committed one is passed over before anything is hashed). The small
    files the run's task read are each found by their content when the task asks for them."""
    with run_files(m) as found:
        dataset, note = _committed_dataset(task, m)
    return dataset, "; ".join([*found_notes(found), *([note] if note else [])]) or None


def _committed_dataset(task: Task, m: Manifest) -> tuple[Dataset, str | None]:
    """The training split whose root the manifest commits (within ``run_files``), where the recipe's
    names point or in any file of the search path that could hold it. (Only the training split is
    found so: its root is what the run claims, and what the audit checks. An evaluation split is the
    verifier's own, by name: ``witness.evals.evaluate.evaluation_split``.)"""
    pins = m.raw.get("data_files") or {}

    def matches(dataset: Dataset) -> bool:
        return len(dataset) == m.dataset_size and same(dataset.commitment_root(m.data_commitment), m.data_root)

    what = "the committed dataset"
    problem = None
    with asked() as names:
        try:
            # the task as built may have read its files by name already: read them where they were found
            dataset = (type(task).from_config(m.task_config) if pins else task).dataset()
            if matches(dataset):
                return dataset, None
            problem = f"the one here holds {len(dataset)} samples with another root"
        except FileNotFoundError as e:
            problem = str(e) if e.args and any(n in str(e) for n in pins) else "missing"
        except (OSError, ValueError) as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - the task's own loader failing on what is here: not the data
            problem = f"{type(e).__name__}: {e}"
    if not names:  # built already (a cached task): ask a fresh one which names it reads
        with asked() as names:
            try:
                type(task).from_config(m.task_config).dataset()
            except Exception:  # noqa: BLE001 - asked only which names it reads; what it raised is said above
                pass
    for name in [n for n in names if n not in pins]:  # a pinned one was looked for by its content
        for path in candidates(name):
            with pinned({name: path}):
                try:
                    dataset = type(task).from_config(m.task_config).dataset()
                    if not matches(dataset):
                        continue
                except Exception:  # noqa: BLE001 - a folder the task's own loader chokes on is just not the data
                    continue
            return dataset, f"{what} is {path} (found by its root; the recipe names {name!r})"
    want = f"root {m.data_root.hex()[:16]}…, {m.dataset_size} samples"
    interactive = ", or verify with --mode interactive and the trainer's response, which needs no data"
    if not names:  # a dataset the task builds from no data file of its own (the standard library's)
        raise MalformedInput(f"{what} ({want}) is not the one here ({problem}){interactive}")
    where = ", ".join(str(d) for d in search_path())
    raise MalformedInput(
        f"{what} (the recipe's data {', '.join(repr(n) for n in names)}, {want}) is not here "
        f"({problem}), and no file in the data folders ({where}) has that root: pass the folder it lies in with --data "
        f"DIR (or WITNESS_DATA){interactive}")
