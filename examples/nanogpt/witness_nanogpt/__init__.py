"""nanoGPT's train.py as a witness task: its own model.py (linked into this package, which pins it) and token files."""
from dataclasses import asdict, fields, make_dataclass

from witness.task.generic import GenericConfig, GenericTask, TokenWindows, nanogpt_lr

from .model import GPT, GPTConfig

# the recipe: witness's fields (steps, batch_size, grad_accum, lr, warmup, ...), GPTConfig's, get_lr's and the data's
Config = make_dataclass("Config", [(f.name, f.type, f.default) for f in fields(GPTConfig)] + [
    ("min_lr", float, 6e-5), ("lr_decay_iters", int, 600000), ("decay_lr", bool, True), ("dataset", str, "openwebtext")],
    bases=(GenericConfig,), frozen=True)


class NanoGPT(GenericTask):
    name, Config = "nanogpt", Config

    @classmethod
    def recipe_from(cls, s, model):  # train.py's settings, and the model it built
        if s["init_from"] != "scratch":
            raise ValueError("witness certifies a run from its seeded initial state: init_from must be 'scratch'")
        accum = s["gradient_accumulation_steps"]  # and steps: train.py takes iter_num 0..max_iters
        return dict(asdict(model.config), steps=s["max_iters"] + 1, batch_size=s["batch_size"] * accum, grad_accum=accum,
                    lr=s["learning_rate"], warmup=s["warmup_iters"], weight_decay=s["weight_decay"], grad_clip=s["grad_clip"],
                    optimizer_args={"betas": [s["beta1"], s["beta2"]]}, compile=s["compile"],
                    **{k: s[k] for k in ("min_lr", "lr_decay_iters", "decay_lr", "dataset")})

    def make_model(self):
        return GPT(GPTConfig(**{f.name: getattr(self.config, f.name) for f in fields(GPTConfig)}))

    def make_dataset(self):  # get_batch's windows: block_size + 1 tokens of data/<dataset>/train.bin
        return TokenWindows(f"data/{self.config.dataset}/train.bin", self.config.block_size)

    def loss(self, model, batch, generator):  # the model's own loss, what train.py backpropagates
        return model(*batch)[1]

    def predict(self, model, batch):  # the logits at every position (the probes' outputs)
        return model(*batch)[0]

    def lr_at(self, it):  # train.py's get_lr
        return nanogpt_lr(it, *(getattr(self.config, k) for k in ("lr", "warmup", "lr_decay_iters", "min_lr"))) if self.config.decay_lr else self.config.lr
