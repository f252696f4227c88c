"""The released model file: the run's final weights as a plain safetensors file.

It is the subject of every in-toto Statement witness signs (data proofs, evaluation
certificates, the leaderboard's certification), named by the SHA-256 of its bytes, so that
sigstore and in-toto tooling can match a statement to the file people download. The run's own
state and model hashes stay in each statement's predicate (inside the signed tree head).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..bundle.checkpoint import file_sha256, read_checkpoint, save_safetensors
from ..bundle.reader import Bundle
from ..bundle.state import model_hash, state_hash
from ..commit.hashing import same
from ..errors import MalformedInput, VerificationError
from .identity import identify_weights
from .weights import check_tied, read_weights


def final_model_tensors(bundle: Bundle, needed_for: str = "a final model") -> dict[str, torch.Tensor]:
    """The ``model.*`` tensors of the run's final checkpoint, after checking it is the committed final state."""
    if bundle.end is None:
        raise MalformedInput(f"only a finished run has {needed_for}")
    tensors = read_checkpoint(bundle.checkpoints[len(bundle.steps)])
    if not same(state_hash(tensors, bundle.manifest.state_digest), bundle.end.final_state_hash):
        raise VerificationError("the final checkpoint is not the committed final state", check="checkpoint")
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def export_model(bundle: Bundle, path: str | os.PathLike, aliases: list[tuple[str, ...]] | None = None) -> dict:
    """Write the run's final model (``state_dict`` names, no optimizer) to ``path``; its in-toto subject.
    Tied names are written each with the one tensor's bytes (a final state whose tied names differ is refused);
    ``aliases``: the tied names, where the registered task cannot say (a submitted method's, from the sandbox)."""
    tensors = final_model_tensors(bundle, "a final model to release")
    check_tied(bundle, tensors, "the final checkpoint", aliases)
    model = {k[len("model."):]: v.contiguous() for k, v in tensors.items()}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_safetensors(model, tmp, {"witness.task": bundle.manifest.task,
                                  "witness.final_model_hash": bundle.end.final_model_hash.hex()})
    os.replace(tmp, path)  # never leave a half-written release where a reader expects a whole one
    return subject_of(path)


def subject_of(path: str | os.PathLike) -> dict:
    """An in-toto subject naming a file by its SHA-256."""
    return {"name": Path(path).name, "digest": {"sha256": file_sha256(Path(path)).hex()}}


def model_subject(bundle: Bundle, path: str | os.PathLike) -> dict:
    """The subject for a released model file, after checking it holds exactly the run's final model."""
    if bundle.end is None:
        raise MalformedInput("only a finished run has a final model")
    found = identify_weights(bundle, path)
    if not found.same:
        raise MalformedInput(f"{path} does not hold the run's final model ({found.detail}); witness export "
                             "writes that file")
    return subject_of(path)


def release_file(bundle: Bundle, path: str | os.PathLike) -> dict:
    """The subject of the release at ``path``: checked if the file exists, exported there if not."""
    return model_subject(bundle, path) if Path(path).exists() else export_model(bundle, path)


def check_subject(stmt: dict | None, model_file: str | os.PathLike, final_model_hash: bytes,
                  digest: str | None = None) -> dict[str, torch.Tensor]:
    """A signed Statement is about ``model_file``: its SHA-256 is the subject's, and it holds the model
    whose hash the statement's predicate commits (``final_model_hash``, by the run's ``digest``;
    either supported digest when the run's manifest is not at hand). The file's weights, as read."""
    from ..bundle.state import DIGESTS

    if stmt is None:
        raise MalformedInput("checking a model file needs the signed envelope (the .dsse.json file), not bare JSON")
    subjects = stmt.get("subject")
    want = file_sha256(Path(model_file)).hex()
    if not isinstance(subjects, list) or not any(isinstance(s, dict) and isinstance(s.get("digest"), dict)
                                                  and s["digest"].get("sha256") == want for s in subjects):
        raise VerificationError(f"the statement is not about {Path(model_file).name} (SHA-256 {want[:16]}…)",
                                check="subject")
    weights = read_weights(model_file)
    if not any(same(model_hash(weights, d), final_model_hash) for d in ([digest] if digest else DIGESTS)):
        raise VerificationError(f"{Path(model_file).name} does not hold the model the statement's run ended with",
                                check="subject")
    return weights
