"""The trainer's side of interactive verification: answer challenges with states and samples."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tqdm import tqdm

from ..bundle.checkpoint import read_checkpoint, save_checkpoint
from ..bundle.reader import open_bundle
from ..bundle.state import load_state, state_tensors
from ..commit.hashing import canonical_json
from ..data.order import derive_run_seed
from ..data.proofs import pair_to_json
from ..data.usage import UsageCommitment
from ..errors import MalformedInput
from ..session import TrainingSession
from .audit import task_of, use_threads
from .challenges import draw_challenges
from .replay import SegmentPlan, states_read
from .response import FORMAT, VERSION


def respond(bundle_dir: str | os.PathLike, out: str | os.PathLike, *, nonce: bytes, challenges: int,
            length: int = 1, tolerance: bool = False, progress: bool = False, device: str | None = None) -> Path:
    """Answer the challenges that ``nonce`` draws: the committed state each challenged segment starts
    from (and ends at, with ``tolerance``), rebuilt by replay from the checkpoints, and every
    replayed step's samples with their proofs."""
    bundle = open_bundle(bundle_dir)
    m = bundle.manifest
    task = task_of(bundle)
    dataset = task.dataset()
    if dataset.commitment_root(m.data_commitment) != m.data_root or derive_run_seed(m.data_root, m.r) != m.run_seed:
        raise MalformedInput("this machine's dataset is not the one the run committed to")
    # A run that commits its dataset's leaves is checked against them: its samples need no proofs.
    proven = m.data_commitment < 2
    usage = UsageCommitment.from_batches(dataset, (r.batch for r in bundle.steps)) \
        if bundle.complete and proven else None
    drawn = draw_challenges(bundle.final_head, nonce, len(bundle.steps), challenges, length)
    plan = SegmentPlan(bundle.state_steps(), bundle.state_steps())
    # only the states the verifier reads: exact replay goes on through consecutive segments from the
    # states it reached itself (each checked against its commitment), so those are not shipped
    wanted = set(states_read(plan, drawn, exact=not tolerance))
    steps: set[int] = set()
    for ch in drawn:
        start, end = plan.segment(ch.step, ch.length)
        steps.update(range(start, end))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "states").mkdir(parents=True)
    # The trainer rebuilds the states it did not keep by replaying its own steps from its checkpoints
    # (nothing is compared here: the verifier checks every state against the log's commitments).
    # the trainer rebuilds its states where it trained (the committed hashes are of those bits)
    session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.parallelism,
                              device or m.device["kind"])
    checkpoints = SegmentPlan(bundle.checkpoint_steps(), bundle.checkpoint_steps())
    position: int | None = None
    states: dict[str, str] = {}
    with use_threads(m.threads, None):
        for step in tqdm(sorted(wanted), desc="answering challenges", unit="state", disable=not progress):
            start = checkpoints.start(step)
            if position is None or not start <= position <= step:
                load_state(session.model, session.optimizer, read_checkpoint(bundle.checkpoints[start]))
                position = start
            while position < step:
                session.step(position, [dataset.sample_bytes(i) for i in bundle.steps[position].batch])
                position += 1
            name = f"states/{step:08d}.safetensors"
            save_checkpoint(out / name, state_tensors(session.model, session.optimizer), step, m.state_digest)
            states[str(step)] = name
    answers: dict[str, dict] = {}
    for t in sorted(steps):
        idx = list(bundle.steps[t].batch)
        samples = [dataset.sample_bytes(i) for i in idx]
        answers[str(t)] = {
            "indices": idx,
            "samples": [s.hex() for s in samples],
            "proofs": [[h.hex() for h in dataset.tree.inclusion_proof(i)] if proven else [] for i in idx],
            "used": None if usage is None else [
                {"sample": pair_to_json(usage.samples.prove_member(dataset.hashes[i])),
                 "document": pair_to_json(usage.documents.prove_member(dataset.document_of(s)))}
                for i, s in zip(idx, samples, strict=True)],
        }
    doc = {
        "format": FORMAT, "version": VERSION, "head_root": bundle.final_head.root.hex(),
        "head_size": bundle.final_head.size, "states": states, "steps": answers,
    }
    (out / "response.json").write_bytes(canonical_json(doc))
    return out
