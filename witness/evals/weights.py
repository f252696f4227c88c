"""A released model's weights: read from a file, and checked to tie where the task's model ties.

Both ``identity`` (is it the run's final model?) and ``release`` (export and subjects) build on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..bundle.checkpoint import read_checkpoint
from ..bundle.reader import Bundle
from ..bundle.state import check_aliases
from ..errors import MalformedInput
from ..fingerprint.chunks import alias_groups


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A weights file as ``model.*`` tensors: a witness checkpoint, or a plain model state dict."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise MalformedInput(f"{p} is not a file")
    try:
        return {k: v for k, v in read_checkpoint(p).items() if k.startswith("model.")}
    except MalformedInput:
        pass
    if p.stat().st_size > 8 * 1024**3:
        raise MalformedInput(f"{p} is too large")
    try:
        return {f"model.{k}": v for k, v in load_file(str(p)).items()}
    except (SafetensorError, ValueError, OSError) as e:
        raise MalformedInput(f"{p} is not a safetensors weights file: {e}") from None


def check_tied(bundle: Bundle, tensors: dict[str, torch.Tensor], where: str,
               aliases: list[tuple[str, ...]] | None = None) -> None:
    """``tensors`` (``model.*``) hold the same bytes under every name the task's own model ties; which
    names those are comes from the model the registry builds for the run's recipe (or ``aliases``, a submitted
    method's own description), never from the bundle."""
    from ..verify.cheap import task_of

    if aliases is None:
        aliases = alias_groups(task_of(bundle).build_model(bundle.manifest.run_seed))
    check_aliases(aliases, tensors, where)
