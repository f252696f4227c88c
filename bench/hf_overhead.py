"""What witnessing adds to a Hugging Face Trainer step: the same Trainer run with and without
``witness.integrations.hf.attach``, alternated in one process.

Both runs train the same GPT-2 (built from a config) on the same byte windows with the same
optimizer and schedule; the plain one is a stock Trainer (its own sampler and loss), the
witnessed one runs the committed order and records every step (fingerprint, sketch, the hash of
the whole training state, one log line). Checkpoints, which a trainer writes anyway, fall
outside the measured steps. Step times are taken by one timing callback in both runs, from one
step's begin to the next one's, so every callback is inside them.

    python bench/hf_overhead.py [--rounds 3] [--steps 12] [--json out.json]
"""

from __future__ import annotations

import time
from pathlib import Path

from common import compare_runs, time_hooks
from transformers import Trainer, TrainerCallback, TrainingArguments

from witness.commit.signing import generate_key
from witness.integrations.hf import attach, committed_dataset
from witness.record import Commitments, Recorder, SelfChecking
from witness.task import build_task

CONFIG = {"batch_size": 16, "block": 128, "n_layer": 4, "n_head": 8, "d_model": 256, "warmup": 2,
          "probes": 4, "probe_len": 16, "corpus_max_bytes": 2_000_000}


class StepTimes(TrainerCallback):
    """Wall time from one step's begin to the next one's: the whole loop, every callback in it
    (the recorder's record is written in its step-end callback)."""

    def __init__(self):
        self.times: list[float] = []
        self.last: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def run(witnessed: bool, steps: int, out: Path) -> list[float]:
    """Per-step times (the first two, warm-up, left out; the last, with the final checkpoint and
    the end record, is not between two step begins) of one Trainer run."""
    task = build_task("hf-gpt2", dict(CONFIG, steps=steps))
    c = task.config
    args = TrainingArguments(output_dir=str(out / "trainer"), max_steps=steps, learning_rate=c.lr,
                             per_device_train_batch_size=c.batch_size, warmup_steps=c.warmup, weight_decay=0.0,
                             lr_scheduler_type="linear", max_grad_norm=c.grad_clip, save_strategy="no",
                             report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True)
    timer = StepTimes()
    if witnessed:
        # one checkpoint at the end only: the trainer's own checkpoint writes are not the recorder's cost
        rec = Recorder.create(task, out / "run", generate_key(), r=b"\x01" * 32,
                              commit=Commitments(checkpoint_every=steps),
                              self_check=SelfChecking(enabled=False))  # steady-state step cost only
        trainer = Trainer(model=rec.model, args=args, train_dataset=committed_dataset(rec),
                          optimizers=(rec.optimizer, None), callbacks=[timer])
        attach(trainer, rec)
        time_hooks(trainer.callback_handler.callbacks[-1], ("on_step_begin", "on_step_end"))
    else:
        model = task.build_model(b"\x01" * 32)
        data = [{"input_ids": t} for t in task.collate([task.dataset().sample_bytes(i)
                                                        for i in range(steps * c.batch_size)])["input_ids"]]

        class Plain(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return task.loss(model, {"input_ids": inputs["input_ids"]}, None)

        trainer = Plain(model=model, args=args, train_dataset=data, optimizers=(task.build_optimizer(model), None),
                        callbacks=[timer])
    trainer.train()
    return timer.times[2:]


def main() -> dict:
    return compare_runs(__doc__, run, CONFIG, rounds=3, steps=12)


if __name__ == "__main__":
    main()
