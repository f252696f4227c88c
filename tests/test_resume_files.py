"""``--resume`` reads the run's own folder: a journal or log that is not a regular file, or is larger than any
run writes, is refused in one line (exit 2), never a hang or a machine out of memory (issue 52, item 10)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from witness.bundle import layout
from witness.bundle.writer import read_lines


def _train(out, key, *extra):
    return [sys.executable, "-m", "witness.cli", "train", "--task", "tiny", "--steps", "4", "--checkpoint-every", "2",
            "--quiet", "--key", str(key), "--out", str(out), *extra]


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_resume_refuses_a_log_that_is_not_a_file(tmp_path, kind):
    out, key = tmp_path / "run", tmp_path / "k.pem"
    assert subprocess.run(_train(out, key), capture_output=True, timeout=300).returncode == 0
    log = out / "log.jsonl"
    log.unlink()
    if kind == "fifo":
        os.mkfifo(log)  # a read of it would wait for a writer for ever
    else:
        log.symlink_to("/dev/zero")  # a read of it would fill the memory
    res = subprocess.run(_train(out, key, "--resume"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "is not a regular file" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_the_journal_of_cosigned_checkpoints_is_read_within_its_bound(tmp_path):
    journal = tmp_path / "cosigned.jsonl"
    with open(journal, "wb") as f:  # sparse: its size is what a stat says, and nothing is read
        f.truncate(layout.MAX_JOURNAL_BYTES + 1)
    with pytest.raises(ValueError, match="over the"):
        read_lines(journal, layout.MAX_JOURNAL_BYTES)
    journal.write_bytes(b'{"a":1}\n{"b":')
    assert read_lines(journal, layout.MAX_JOURNAL_BYTES) == [b'{"a":1}']  # a torn last line is dropped
