"""run_clm.py as a witness task: its own model, tokenizer and dataset (run_clm.py, linked into this package, which pins it)."""
from dataclasses import make_dataclass

import torch.nn.functional as F
from witness.data.locate import data_file
from witness.integrations.hf import trainer_lr, trainer_recipe
from witness.task.generic import GenericConfig, GenericTask

from .run_clm import build_model, load_blocks

# the recipe: witness's fields (steps, batch_size, grad_accum, lr, warmup, grad_clip, ...), and the model's
Config = make_dataclass("Config", [("block", int, 32), ("vocab_size", int, 64), ("n_layer", int, 2), ("n_embd", int, 64), ("dropout", float, 0.1)], bases=(GenericConfig,), frozen=True)


class CLM(GenericTask):
    name, Config = "clm", Config

    @classmethod
    def recipe_from(cls, args, model):  # the TrainingArguments, and the GPT-2 the script built
        m = model.config
        return trainer_recipe(args) | dict(block=m.n_positions, vocab_size=m.vocab_size, n_layer=m.n_layer,
                                           n_embd=m.n_embd, dropout=m.resid_pdrop)

    def make_model(self):  # the script's own
        return build_model(*(getattr(self.config, k) for k in ("vocab_size", "block", "n_layer", "n_embd", "dropout")))

    def make_dataset(self):  # the script's own list of blocks, read from a text file with its own tokenizer
        return load_blocks(data_file("data/clm/train.txt"), data_file("data/clm/vocab.json"), self.config.block)

    def loss(self, model, batch, generator):  # GPT-2's own loss on its labels, what the Trainer backpropagates
        return model(**batch).loss

    def predict(self, model, batch):
        return model(**batch).logits

    def example_losses(self, logits, batch):  # per token, next-token (for the probes)
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")

    def lr_at(self, step):  # the Trainer's linear schedule
        return trainer_lr(self.config, step)
