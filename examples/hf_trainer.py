"""A stock Hugging Face ``Trainer`` script, witnessed: the lines marked ``# witness`` are all it adds.

GPT-2 built from a config (random weights, no download), trained on the Python standard
library's own sources, byte by byte. Then ``witness verify OUT`` checks the run.

    python examples/hf_trainer.py --out hf-run [--steps 40]
"""

from __future__ import annotations

import argparse
import os

from transformers import Trainer, TrainingArguments

from witness.beacon.client import BeaconClient
from witness.commit.signing import load_or_create_key
from witness.integrations.hf import attach, committed_dataset  # witness
from witness.record import Commitments, Online, Recorder  # witness
from witness.task import build_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--key", default="witness-key.pem")
    p.add_argument("--beacon", help="take online challenges from the beacon at this URL")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropout (its masks replay from the step seed)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches a step (gradient_accumulation_steps)")
    a = p.parse_args(argv)
    recipe = {"steps": a.steps, "batch_size": 8, "block": 32, "n_layer": 2, "n_head": 2, "d_model": 64,
              "warmup": 4, "corpus_max_bytes": 300_000, "dropout": a.dropout,
              "grad_accum": a.grad_accum}
    task = build_task("hf-gpt2", recipe)
    rec = Recorder.create(task, a.out, load_or_create_key(a.key), r=os.urandom(32),  # witness
                          commit=Commitments(checkpoint_every=10),  # witness
                          online=Online(beacon=BeaconClient(a.beacon) if a.beacon else None))  # witness: online challenges
    c = task.config
    args = TrainingArguments(output_dir=os.path.join(a.out + ".trainer"), max_steps=c.steps, learning_rate=c.lr,
                             per_device_train_batch_size=c.batch_size // c.grad_accum,
                             gradient_accumulation_steps=c.grad_accum, warmup_steps=c.warmup, weight_decay=0.0,
                             lr_scheduler_type="linear", max_grad_norm=c.grad_clip, save_strategy="no",
                             report_to=[], logging_steps=10, use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=rec.model, args=args, train_dataset=committed_dataset(rec),
                      optimizers=(rec.optimizer, None))  # witness: the recorder's model, data and optimizer
    attach(trainer, rec)  # witness
    trainer.train()
    print(f"wrote {a.out}: verify it with  witness verify {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
