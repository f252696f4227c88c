"""The trainer's side of interactive verification: answer challenges with states and samples."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tqdm import tqdm

from ..bundle.checkpoint import load_state, read_checkpoint, save_checkpoint, state_tensors
from ..bundle.reader import open_bundle
from ..commit.hashing import canonical_json
from ..data.order import derive_run_seed
from ..errors import MalformedInput
from ..record.session import TrainingSession
from .audit import task_of
from .challenges import draw_challenges
from .response import FORMAT, VERSION


def respond(bundle_dir: str | os.PathLike, out: str | os.PathLike, *, nonce: bytes, challenges: int,
            length: int = 1, progress: bool = False) -> Path:
    """Rebuild the state before every challenged step (replaying from checkpoints) and write a response."""
    bundle = open_bundle(bundle_dir)
    m = bundle.manifest
    task = task_of(bundle)
    dataset = task.dataset()
    if dataset.root != m.data_root or derive_run_seed(m.data_root, m.r) != m.run_seed:
        raise MalformedInput("this machine's dataset is not the one the run committed to")
    drawn = draw_challenges(bundle.final_head, nonce, len(bundle.steps), challenges, length)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "states").mkdir(parents=True)
    session = TrainingSession(task, m.run_seed, m.dataset_size, m.world_size, m.raw["parallelism"])
    position: int | None = None
    states: dict[str, str] = {}
    steps: dict[str, dict] = {}
    for ch in tqdm(drawn, desc="answering challenges", unit="challenge", disable=not progress):
        start = max(c for c in bundle.checkpoint_steps() if c <= ch.step)
        if position is None or position < start or position > ch.step:
            load_state(session.model, session.optimizer, read_checkpoint(bundle.checkpoints[start]))
            position = start
        while position < ch.step:
            rec = bundle.steps[position]
            session.step(position, [dataset.sample_bytes(i) for i in rec.batch])
            position += 1
        name = f"states/{ch.step:08d}.safetensors"
        save_checkpoint(out / name, state_tensors(session.model, session.optimizer), ch.step)
        states[str(ch.step)] = name
        for t in range(ch.step, ch.step + ch.length):
            idx = list(bundle.steps[t].batch)
            steps[str(t)] = {
                "indices": idx,
                "samples": [dataset.sample_bytes(i).hex() for i in idx],
                "proofs": [[h.hex() for h in dataset.tree.inclusion_proof(i)] for i in idx],
            }
    doc = {
        "format": FORMAT, "version": VERSION, "head_root": bundle.final_head.root.hex(),
        "head_size": bundle.final_head.size, "nonce": nonce.hex(), "states": states, "steps": steps,
    }
    (out / "response.json").write_bytes(canonical_json(doc))
    return out
