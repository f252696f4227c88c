"""The state hash taken off the training stream (a copy hashed in a background thread) writes the
same records as the hash taken in line; the copy is of the state after its step."""

from __future__ import annotations

import pytest

from witness.commit.hashing import parse_canonical_json
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder
from witness.task import build_task
from witness.verify import Policy, Verifier

CONFIGS = {
    "tinygpt": {"steps": 9, "batch_size": 4, "block": 32, "n_layer": 1, "d_model": 32, "n_head": 2,
                "corpus_max_bytes": 200_000},
    "tinycnn": {"steps": 9},  # BatchNorm: buffers the next forward changes before the optimizer steps
}


def _train(task_name: str, out, key, overlap: bool) -> list[dict]:
    task = build_task(task_name, CONFIGS[task_name])
    rec = Recorder.create(task, out, key, r=b"\x03" * 32, commit=Commitments(checkpoint_every=3))
    rec.overlap = overlap
    for t in range(task.config.steps):
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
        if overlap and t % 3 != 2:  # between checkpoints a record waits for its hash
            assert rec._deferred is not None and rec._deferred[0]["step"] == t
    rec.finish()
    # every line, checkpoint files' SHA-256s included (the same state is written as the same bytes)
    return [parse_canonical_json(line) for line in (out / "log.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize("task_name", sorted(CONFIGS))
def test_an_overlapped_state_hash_writes_the_same_log(task_name, tmp_path):
    key = generate_key()
    inline = _train(task_name, tmp_path / "inline", key, overlap=False)
    overlapped = _train(task_name, tmp_path / "overlap", key, overlap=True)
    assert overlapped == inline and sum("state_hash" in r for r in inline) == CONFIGS[task_name]["steps"]
    assert Verifier(policy=Policy(challenges=9, nonce=b"\x04")).verify(tmp_path / "overlap").accepted
