"""A Lightning script as people write it, witnessed: the lines marked ``# witness`` are all that
witnessing adds or changes. Its own ``LightningModule`` (dropout, AdamW with a per-step
``LambdaLR``), its own dataset and ``DataLoader``, a stock ``Trainer`` with accumulation and
clipping.

    python train_lit.py [--out run]        # then: witness verify run
    WITNESS_BEACON=URL python train_lit.py  # the same, taking online challenges from a beacon
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from witness.integrations.lightning import WitnessCallback, committed_loader  # witness
from witness.record import start_run  # witness


class LitClassifier(L.LightningModule):
    """A small classifier of points by their largest coordinate."""

    def __init__(self, hidden: int = 32, lr: float = 0.01, dropout: float = 0.2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.1 * t))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def points(n: int = 512, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """The dataset: random points, labelled by which of their first three coordinates is largest."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return [{"x": x[i], "y": x[i, :3].argmax()} for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="run")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    model = LitClassifier()
    loader = torch.utils.data.DataLoader(points(), batch_size=8, shuffle=True)
    trainer = L.Trainer(max_steps=a.steps, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu",
                        devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    rec = start_run("lit-points", {"trainer": trainer, "loader": loader}, a.out, model=model)  # witness
    trainer.callbacks.append(WitnessCallback(rec))  # witness
    trainer.fit(model, train_dataloaders=committed_loader(rec, loader))  # witness (was: trainer.fit(model, loader))


if __name__ == "__main__":
    main()
