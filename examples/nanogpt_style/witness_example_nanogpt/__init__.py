"""The example's model and data as a witness task: what a verifier installs to replay its runs."""

from dataclasses import dataclass

from witness.task.generic import GenericConfig, GenericTask
from witness.task.samples import TokenWindows

from .model import GPT, GPTConfig, get_lr


@dataclass(frozen=True)
class Config(GenericConfig):  # steps, batch_size, grad_accum, lr, warmup, grad_clip, ... and train.py's own
    data: str = "train.bin"  # a name in a data folder (--data DIR), never an absolute path
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.1
    min_lr: float = 1e-4  # the cosine decays to it over all the steps (lr_decay_iters = max_iters)


class NanoGPTStyle(GenericTask):
    name = "nanogpt-style"
    Config = Config

    def make_model(self):  # the loop's own model, from the recipe's model_args
        return GPT(GPTConfig(**{k: getattr(self.config, k) for k in ("block_size", "n_layer", "n_head", "n_embd", "dropout")}))

    def make_dataset(self):  # windows of block_size + 1 byte tokens, the file found by name in the data folders
        return TokenWindows(self.config.data, self.config.block_size, tokenize=str.encode)

    def loss(self, model, batch, generator):
        return model(*batch)[1]  # the loop's own loss: the mean over every token of the batch

    def predict(self, model, batch):  # the logits at every position (the probes' outputs)
        return model(*batch)[0]

    def lr_at(self, step):  # the loop's own schedule function
        return get_lr(step, self.config.lr, self.config.warmup, self.config.steps, self.config.min_lr)
