"""``tinygpt``: a byte-level GPT on the Python standard library's own source files.

Every kernel is chosen so that CPU replay is bit-identical across thread counts: a
hand-written LayerNorm (``nn.LayerNorm``'s weight gradient is thread-dependent), explicit
attention (no fused kernel), and dropout drawn from the step's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data.stdlib import StdlibWindows, window_tokens
from .base import Task, init_parameters

# Fixed probe texts: part of the recipe, independent of which stdlib is on the machine.
PROBE_TEXTS = [
    "def __init__(self, *args, **kwargs):\n",
    "import os\nimport sys\nfrom collections import ",
    "    for i in range(len(self._items)):\n",
    "class Error(Exception):\n    \"\"\"Base class",
    "        return self._cache.get(key, default)\n",
    "if __name__ == '__main__':\n    main()\n",
    "    raise ValueError(f\"invalid value {value!r}\")\n",
    "with open(path, 'rb') as f:\n    data = f.read()\n",
]


@dataclass(frozen=True)
class TinyGPTConfig:
    """Recipe of the ``tinygpt`` task."""

    steps: int = 300
    batch_size: int = 16
    block: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.1
    lr: float = 0.003
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    probes: int = 4
    probe_len: int = 16
    corpus_max_bytes: int = 0
    fingerprint_dims: int = 8
    sketch_dims: int = 8
    precision: str = "fp32"  # or "bf16": autocast over fp32 master weights
    # Recompute each block's activations in the backward pass instead of keeping them: memory
    # for compute, with the same bits (the recomputation runs the same kernels on the same inputs).
    activation_checkpointing: bool = False
    # micro-batches a step's batch is split into, their gradients accumulated (Task.train_step)
    grad_accum: int = 1

    # added after runs were recorded without them: in the recipe only where not the default
    LATER_FIELDS = ("activation_checkpointing", "grad_accum")


# The witnessed tinygpt at the method's scale, for GPUs (recipe fields for --config). The
# vocabulary is bytes, so "gpt2-small" is GPT-2 small's body (12 layers of width 768: 86 M
# parameters; GPT-2's 50,257-token embedding adds 39 M more) and "1b" has 1.2 B parameters.
# Dropout is off, as in large-model pretraining; bf16 autocast over fp32 master weights. A
# batch of 64 windows of 1,024 bytes is 65,536 tokens per step. The explicit attention keeps
# its scores for the backward pass: about 80 GB of activations for "gpt2-small" at that batch,
# and about 220 GB for "1b", which therefore recomputes each block's activations instead.
PRESETS: dict[str, dict] = {
    "gpt2-small": {"n_layer": 12, "n_head": 12, "d_model": 768, "block": 1024, "batch_size": 64,
                   "dropout": 0.0, "lr": 0.0006, "warmup": 100, "precision": "bf16", "probe_len": 64},
    "1b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "block": 1024, "batch_size": 64,
           "dropout": 0.0, "lr": 0.0003, "warmup": 100, "precision": "bf16", "probe_len": 64,
           "activation_checkpointing": True},
}


class LayerNorm(nn.Module):
    """LayerNorm written out, so its gradients do not depend on the thread count."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.gain + self.bias


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Dropout whose mask comes from the step's generator (no global RNG)."""
    if p <= 0 or generator is None:
        return x
    keep = torch.rand(x.shape, generator=generator) >= p  # drawn on the CPU: the same mask on any device
    return x * keep.to(x.device) / (1 - p)


class Block(nn.Module):
    """Pre-norm transformer block with explicit causal attention."""

    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.ln1, self.ln2 = LayerNorm(c.d_model), LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.n_head, self.p = c.n_head, c.dropout
        self.recompute = c.activation_checkpointing

    def forward(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Attention then MLP, each with a residual (recomputed in the backward pass if asked)."""
        if self.recompute and torch.is_grad_enabled():
            # inside the block: under FSDP2 its parameters are gathered again for the backward
            # pass before the recomputation runs, as for any backward through the block
            return checkpoint(self.compute, x, generator, use_reentrant=False)
        return self.compute(x, generator)

    def compute(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The block's arithmetic."""
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        h = self.n_head
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // h) ** 0.5)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + dropout(self.proj(y), self.p, generator)
        return x + dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.p, generator)


class GPT(nn.Module):
    """Byte-level GPT with tied input and output embeddings."""

    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.tok = nn.Embedding(256, c.d_model)
        self.pos = nn.Embedding(c.block, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.d_model)
        self.p = c.dropout

    def forward(self, idx: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits over the next byte."""
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        gen = generator  # dropout only with the step's generator: probes pass none
        x = dropout(x, self.p, gen)
        for b in self.blocks:
            x = b(x, gen)
        return self.ln_f(x) @ self.tok.weight.t()


class TinyGPTTask(Task):
    """Byte-level next-token prediction on stdlib source windows."""

    name = "tinygpt"
    Config = TinyGPTConfig
    document_rule = StdlibWindows.DOCUMENT_RULE  # a window's document is the source file it comes from

    def check_limits(self) -> None:
        """Refuse recipes no verifier should be made to build."""
        super().check_limits()
        c = self.config
        if not (1 <= c.n_layer <= 64 and 1 <= c.n_head <= c.d_model <= 8192 and c.d_model % c.n_head == 0):
            raise ValueError("tinygpt shape out of range")
        if not (2 <= c.block <= 4096 and c.batch_size * c.block <= 1 << 22 and 1 <= c.probes <= len(PROBE_TEXTS)):
            raise ValueError("tinygpt batch or probe shape out of range")
        if not 2 <= c.probe_len <= c.block:
            raise ValueError("probe_len must be within the block")
        if c.activation_checkpointing and c.dropout > 0:
            # the recomputed forward would draw fresh masks from the step's generator
            raise ValueError("activation_checkpointing needs dropout 0")

    @cached_property
    def _dataset(self) -> StdlibWindows:
        c = self.config
        return StdlibWindows(c.block, "train", c.corpus_max_bytes or None)

    def dataset(self) -> StdlibWindows:
        """Stdlib training windows."""
        return self._dataset

    @cached_property
    def _eval(self) -> StdlibWindows:
        c = self.config
        return StdlibWindows(c.block, "eval", c.corpus_max_bytes or None)

    def eval_dataset(self) -> StdlibWindows:
        """Held-out stdlib files (never in the training order)."""
        return self._eval

    def build_model(self, seed: bytes) -> nn.Module:
        """GPT with seed-derived weights."""
        model = GPT(self.config)
        init_parameters(model, seed)
        return model

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Each transformer block: FSDP2 holds one block's full parameters at a time."""
        return list(model.blocks)

    def collate(self, samples: list[bytes]) -> torch.Tensor:
        """Windows of ``block + 1`` bytes -> a [B, block + 1] token tensor."""
        return torch.tensor([list(window_tokens(s)) for s in samples], dtype=torch.long)

    def collate_probes(self, probes: list[bytes]) -> torch.Tensor:
        """Probe texts as a [P, probe_len + 1] token tensor."""
        return torch.tensor([list(p) for p in probes], dtype=torch.long)

    def loss(self, model, batch, generator):
        """Next-byte cross-entropy."""
        logits = model(batch[:, :-1], generator)
        return F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    def probe_bytes(self) -> list[bytes]:
        """The first ``probes`` probe texts, padded with spaces and cut to ``probe_len + 1`` bytes."""
        n = self.config.probe_len + 1
        return [t.encode().ljust(n)[:n] for t in PROBE_TEXTS[: self.config.probes]]

    def probe_outputs(self, model, probes):
        """Next-byte logits on the probe texts."""
        return model(probes[:, :-1])

    def probe_losses(self, outputs, probes):
        """Per-probe mean next-byte loss."""
        return F.cross_entropy(outputs.transpose(1, 2), probes[:, 1:], reduction="none").mean(dim=1)

    @torch.no_grad()
    def eval_example(self, model, sample: bytes) -> dict:
        """Mean next-byte loss of one held-out window (evaluated alone: same bits every time)."""
        tokens = self.collate([sample])
        logits = model(tokens[:, :-1])
        return {"loss": float(F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)))}

    def aggregates(self, examples: list[dict]) -> dict:
        """Mean loss and bits per byte."""
        import math

        out = super().aggregates(examples)
        out["bits_per_byte"] = out["mean_loss"] / math.log(2)
        return out

    def parameter_count(self) -> int:
        """Number of parameters."""
        c = self.config
        d = c.d_model
        per_block = 4 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
        return 256 * d + c.block * d + c.n_layer * per_block + 2 * d

    def flops_per_step(self) -> float:
        """6 * params * tokens, plus attention."""
        c = self.config
        tokens = c.batch_size * c.block
        return 6.0 * self.parameter_count() * tokens + 12.0 * c.n_layer * tokens * c.block * c.d_model
