"""A PyTorch Lightning run, witnessed: the lines marked ``# witness`` are all it adds.

tinygpt (a byte-level GPT on the Python standard library's sources) as a ``LightningModule``,
trained by a stock ``lightning.Trainer``. Then ``witness verify OUT`` checks the run.

    python examples/lightning_train.py --out pl-run [--steps 40]
"""

from __future__ import annotations

import argparse
import os

import lightning as L

from witness.beacon.client import BeaconClient
from witness.commit.signing import load_or_create_key
from witness.integrations.lightning import TaskModule, WitnessCallback  # witness
from witness.record import Commitments, Online, Recorder  # witness
from witness.task import build_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--key", default="witness-key.pem")
    p.add_argument("--beacon", help="take online challenges from the beacon at this URL")
    a = p.parse_args(argv)
    recipe = {"steps": a.steps, "batch_size": 8, "block": 32, "n_layer": 1, "d_model": 32, "n_head": 2,
              "warmup": 4, "probes": 2, "probe_len": 8, "corpus_max_bytes": 300_000}
    task = build_task("tinygpt", recipe)
    rec = Recorder.create(task, a.out, load_or_create_key(a.key), r=os.urandom(32),  # witness
                          commit=Commitments(checkpoint_every=10),  # witness
                          online=Online(beacon=BeaconClient(a.beacon) if a.beacon else None))  # witness: online challenges
    trainer = L.Trainer(max_steps=task.config.steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[WitnessCallback(rec)])  # witness
    trainer.fit(TaskModule(rec))  # witness: the task's step on the committed data
    print(f"wrote {a.out}: verify it with  witness verify {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
