"""train_lit.py as a witness task: its own LightningModule and dataset (train_lit.py, linked into this package, which pins it)."""
from dataclasses import make_dataclass

from witness.integrations.lightning import LightningTask
from witness.task.generic import GenericConfig

from .train_lit import LitClassifier, points

# the recipe: witness's fields (steps, batch_size, grad_accum, grad_clip, ...) and the module's hyperparameters
Config = make_dataclass("Config", [("hidden", int, 32), ("lr", float, 0.01), ("dropout", float, 0.2)],
                        bases=(GenericConfig,), frozen=True)


class LitPoints(LightningTask):
    name, Config, module = "lit-points", Config, LitClassifier

    def make_dataset(self):  # the script's own
        return points()
