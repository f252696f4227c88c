"""A causal-language-model script in the style of transformers' run_clm.py, witnessed: the lines
marked ``# witness`` are all that witnessing adds. Its own tokenizer (a character vocabulary in a
JSON file), its own dataset (a list of blocks read from a text file), its own GPT-2 from a config,
and a stock ``Trainer`` with its own AdamW and linear schedule.

    python prepare.py                     # data/clm/train.txt and data/clm/vocab.json
    python run_clm.py --output_dir out    # then: witness verify out/witness
    WITNESS_BEACON=URL python run_clm.py   # the same, taking online challenges from a beacon
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from witness.integrations.hf import attach  # witness
from witness.record import start_run  # witness


def load_vocab(path: str) -> dict[str, int]:
    """The character vocabulary: the characters of the file's ``chars``, in order."""
    with open(path, encoding="utf-8") as f:
        return {c: i for i, c in enumerate(json.load(f)["chars"])}


def load_blocks(text_path: str, vocab_path: str, block: int) -> list[dict[str, torch.Tensor]]:
    """The text as consecutive blocks of ``block`` token ids (run_clm's ``group_texts``), labels = inputs."""
    vocab = load_vocab(vocab_path)
    with open(text_path, encoding="utf-8") as f:
        ids = [vocab[c] for c in f.read() if c in vocab]
    return [{"input_ids": torch.tensor(ids[i:i + block]), "labels": torch.tensor(ids[i:i + block])}
            for i in range(0, len(ids) - block + 1, block)]


def build_model(vocab_size: int, block: int, n_layer: int = 2, n_embd: int = 64, dropout: float = 0.1) -> GPT2LMHeadModel:
    """A small GPT-2 from a config (random weights, no download)."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=block, n_embd=n_embd, n_layer=n_layer,
                                      n_head=2, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      attn_implementation="eager"))


DEFAULTS = ["--max_steps", "12", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--warmup_steps", "3",
            "--lr_scheduler_type", "linear", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "True",
            "--logging_steps", "4", "--disable_tqdm", "True", "--output_dir", "out"]


def main(argv: list[str]) -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses([*DEFAULTS, *argv])
    train_dataset = load_blocks("data/clm/train.txt", "data/clm/vocab.json", block=32)
    model = build_model(len(load_vocab("data/clm/vocab.json")), block=32)
    rec = start_run("clm", vars(args), os.path.join(args.output_dir, "witness"), model=model)  # witness
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    attach(trainer, rec)  # witness
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
