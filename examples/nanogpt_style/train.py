"""A GPT training loop in nanoGPT's style, witnessed. The lines marked ``# witness`` are all that
witnessing adds; the loop is otherwise as it would be without it: its own model and optimizer, its
own get_batch, its own schedule with warm-up, gradient accumulation, clipping and dropout.

    python prepare.py                       # data/train.bin, data/val.bin
    python train.py --out_dir=run           # settings as --name=value, as nanoGPT's configurator
    witness verify run --mode offline       # replays steps bit for bit (finds the data by its root)

The recorder adopts the loop's model (giving it the initial state the run seed fixes, which a
verifier rebuilds) and optimizer; ``rec.batches(get_batch)`` hands the loop the committed batch of
each step, split into the same micro-batches, with each micro-batch's dropout drawn from its
committed seed; each ``optimizer.step()`` is recorded as it returns.
"""

import os
import sys
import time
from ast import literal_eval

import numpy as np
import torch
from witness.record import Commitments, start_run  # witness

from witness_example_nanogpt.model import GPT, GPTConfig, get_lr

# settings (override as --name=value)
out_dir = "run"
data_dir = "data"
key_file = "witness-key.pem"
max_iters = 40
batch_size = 8  # per micro-batch
gradient_accumulation_steps = 2
block_size = 64
n_layer, n_head, n_embd, dropout = 2, 2, 64, 0.1
learning_rate, min_lr, warmup_iters = 1e-3, 1e-4, 5
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
log_interval = 10
for arg in sys.argv[1:]:
    name, value = arg.removeprefix("--").split("=", 1)
    if name not in globals():
        raise SystemExit(f"unknown setting {name}")
    globals()[name] = value if isinstance(globals()[name], str) else literal_eval(value)
lr_decay_iters = max_iters  # the cosine ends at the last step

model_args = dict(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout)
data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


torch.manual_seed(1337)
model = GPT(GPTConfig(**model_args))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
recipe = dict(steps=max_iters, batch_size=batch_size * gradient_accumulation_steps, grad_accum=gradient_accumulation_steps,  # witness
              lr=learning_rate, min_lr=min_lr, warmup=warmup_iters, weight_decay=weight_decay, grad_clip=grad_clip,  # witness
              optimizer_args={"betas": [beta1, beta2]}, data=os.path.join(data_dir, "train.bin"), **model_args)  # witness
rec = start_run("nanogpt-style", recipe, out_dir, model=model, optimizer=optimizer, key=key_file, commit=Commitments(checkpoint_every=10))  # witness
get_batch = rec.batches(get_batch)  # witness: the committed batches, in order

t0 = time.time()
for it in range(max_iters):
    lr = get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
    losses = []
    model.train()
    for _ in range(gradient_accumulation_steps):
        X, Y = get_batch()
        logits, loss = model(X, Y)
        losses.append(loss.item())
        (loss / gradient_accumulation_steps).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train_loss = sum(losses) / len(losses)
    if it % log_interval == 0 or it == max_iters - 1:
        print(f"iter {it}: loss {train_loss:.4f}, lr {lr:.2e}, {1000 * (time.time() - t0) / (it + 1):.0f} ms/iter")
rec.finish()  # witness
print(f"wrote {out_dir}: witness verify {out_dir}")
