"""The offline audit's training data, found by its committed root wherever it lies here."""

from __future__ import annotations

from pathlib import Path

from ..bundle.schema import Manifest
from ..commit.hashing import same
from ..data.dataset import Dataset
from ..data.locate import asked, by_content, candidates, on_search_path, pinned, search_path
from ..errors import MalformedInput
from ..task.base import Task


def _same_file(path: Path, named: Path | None) -> bool:
    return named is not None and path.resolve() == named.resolve()


def _matches(dataset: Dataset, m: Manifest) -> bool:
    return len(dataset) == m.dataset_size and same(dataset.commitment_root(m.data_commitment), m.data_root)


def committed_dataset(task: Task, m: Manifest) -> tuple[Dataset, str | None]:
    """The dataset whose root the manifest commits, and a note where it was not where the recipe's
    names point: the task's own first, then every file of the data search path that could be it
    (a sample count unlike the committed one is passed over before anything is hashed). The small
    files the run's task read (``data_files``: a list of texts, a tokenizer) are each found by their
    content when the task asks for them (``by_content``)."""
    pins = m.raw.get("data_files") or {}
    with by_content(pins) as found:
        dataset, note = _committed_dataset(task, m, pins)
    notes = [f"the data file {name!r} is {path} (found by its content)" for name, path in found.items()
             if not _same_file(path, on_search_path(name))]
    return dataset, "; ".join([*notes, *([note] if note else [])]) or None


def _committed_dataset(task: Task, m: Manifest, pins: dict) -> tuple[Dataset, str | None]:
    problem = None
    with asked() as names:
        try:
            # the task as built may have read its files by name already: read them where they were found
            dataset = (type(task).from_config(m.task_config) if pins else task).dataset()
            if _matches(dataset, m):
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
                    if not _matches(dataset, m):
                        continue
                except Exception:  # noqa: BLE001 - a folder the task's own loader chokes on is just not the data
                    continue
            return dataset, f"the committed dataset is {path} (found by its root; the recipe names {name!r})"
    want = f"root {m.data_root.hex()[:16]}…, {m.dataset_size} samples"
    if not names:  # a dataset the task builds from no data file of its own (the standard library's)
        raise MalformedInput(f"the committed dataset ({want}) is not the one here ({problem}): verify with --mode "
                             "interactive and the trainer's response, which needs no data")
    where = ", ".join(str(d) for d in search_path())
    raise MalformedInput(
        f"the committed dataset (the recipe's data {', '.join(repr(n) for n in names)}, {want}) is not here "
        f"({problem}), and no file in the data folders ({where}) has that root: pass the folder it lies in with --data "
        "DIR (or WITNESS_DATA), or verify with --mode interactive and the trainer's response, which needs no data")
