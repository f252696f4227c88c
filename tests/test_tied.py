"""Tied weights are one tensor. A model that ties its output head to its input embedding (nanoGPT,
Hugging Face's ``tie_word_embeddings``) has two state names for one tensor; the chunk layout lays it
out once, under its first name, and torch loads the later name last. A trainer that swaps the head
alone (its key re-signs everything) is rejected wherever a state, a checkpoint or a released model
is read, naming both names; which names are tied comes from the task's own model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from attacks import GPT as SMALL
from attacks import trainer_states
from helpers import attacker_response, log_lines, resign, train_tiny
from safetensors.torch import save_file
from torch import nn

from witness.bundle.checkpoint import read_checkpoint, save_checkpoint
from witness.bundle.reader import open_bundle
from witness.bundle.state import check_aliases, load_state, model_hash, state_hash, state_tensors
from witness.cli import main
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.signing import generate_key
from witness.errors import VerificationError
from witness.fingerprint.chunks import ChunkLayout, alias_groups
from witness.session import TrainingSession
from witness.task import build_task, registry
from witness.task.base import init_parameters
from witness.task.tinygpt import GPT, TinyGPTTask
from witness.verify.challenges import draw_challenges

TIED = ("model.tok.weight", "model.head.weight")
STEPS = 4


class TiedGPT(GPT):
    """tinygpt with an output head of its own name, tied to the token embedding as nanoGPT ties
    ``lm_head`` to ``wte``: two state names, one tensor."""

    def __init__(self, c):
        super().__init__(c)
        self.head = nn.Linear(c.d_model, 256, bias=False)
        self.head.weight = self.tok.weight


class TiedGPTTask(TinyGPTTask):
    name = "tinygpt-tied"

    def build_model(self, seed: bytes) -> nn.Module:
        model = TiedGPT(self.config)
        init_parameters(model, seed)
        return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An honest tied run of four steps (checkpoints after 0, 2 and 4 updates) and its trainer's key."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.BUILTIN, TiedGPTTask.name, TiedGPTTask)  # as a plugin would register it
        registry._built.cache_clear()
        key = generate_key()
        out = train_tiny(tmp_path_factory.mktemp("tied") / "b", key, task=TiedGPTTask.name,
                         config=dict(SMALL, steps=STEPS), checkpoint_every=2)
        yield out, key
    registry._built.cache_clear()


def stolen_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state with another ``head.weight`` beside its honest embedding."""
    g = torch.Generator().manual_seed(9)
    head = state["model.head.weight"]
    return {**state, "model.head.weight": torch.randn(head.shape, generator=g, dtype=head.dtype) * 0.02}


def forge(honest: Path, key, out: Path, after: int, state: dict[str, torch.Tensor]) -> Path:
    """What the trainer signs: ``state`` as the state after ``after`` updates, with the fingerprint
    and sketch of the model torch loads from it (the later name wins), its state hash, its checkpoint
    file where one is due, and the final hashes where it is the last; the whole log re-signed."""
    shutil.copytree(honest, out)
    b = open_bundle(out)
    m = b.manifest
    session = TrainingSession(build_task(m.task, m.task_config), m.run_seed, m.dataset_size)
    session.model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    lines = log_lines(out)
    rec = parse_canonical_json(lines[after])  # line 0 is the manifest: line t + 1 is step t's record
    rec.update(fingerprint=session.fingerprint().to_json(), sketch=session.sketch(),
               state_hash=state_hash(state, m.state_digest).hex())
    if after in b.checkpoints:
        rec["checkpoint_sha256"] = save_checkpoint(b.checkpoints[after], state, after, m.state_digest)[1].hex()
    lines[after] = canonical_json(rec)
    if after == len(b.steps):
        end = parse_canonical_json(lines[-1])
        end.update(final_state_hash=rec["state_hash"], final_model_hash=model_hash(state, m.state_digest).hex())
        lines[-1] = canonical_json(end)
    resign(out, key, lines)
    return out


def nonce_avoiding(bundle: Path, step: int) -> str:
    """A nonce whose one challenge is not ``step``: replay alone would miss a bad step there."""
    b = open_bundle(bundle)
    return next(n.hex() for n in (bytes([i]) for i in range(256))
                if step not in {c.step for c in draw_challenges(b.final_head, n, len(b.steps), 1)})


# --- which names are tied, from the model -----------------------------------------------------

def test_an_honest_tied_state_loads_and_its_layout_holds_the_tensor_once_under_its_first_name():
    task = TiedGPTTask.from_config(dict(SMALL, steps=STEPS))
    model = task.build_model(b"\x01" * 32)
    assert alias_groups(model) == [TIED]
    names = ChunkLayout.of_model(model).names
    assert "model.tok.weight" in names and "model.head.weight" not in names
    state = {k: v.clone() for k, v in state_tensors(model, None).items()}
    fresh = task.build_model(b"\x02" * 32)
    load_state(fresh, None, state)
    assert torch.equal(fresh.tok.weight, state["model.tok.weight"]) and fresh.head.weight is fresh.tok.weight
    # bytes, not values: a NaN equals itself, and -0.0 is not 0.0
    state["model.tok.weight"][0, 0] = state["model.head.weight"][0, 0] = float("nan")
    load_state(fresh, None, state)
    state["model.tok.weight"][0, 0], state["model.head.weight"][0, 0] = 0.0, -0.0
    with pytest.raises(VerificationError, match="model.tok.weight and model.head.weight"):
        load_state(fresh, None, state)


def test_untied_models_have_no_aliases_and_their_layout_is_every_parameter():
    for name, config in (("tinygpt", SMALL), ("tiny", {})):
        model = build_task(name, config).build_model(b"\x03" * 32)
        assert alias_groups(model) == []
        assert ChunkLayout.of_model(model).names == sorted(f"model.{n}" for n, _ in model.named_parameters())


def test_a_hugging_face_model_that_ties_its_word_embeddings_has_both_names_in_one_group():
    import transformers  # installed with the project's [hf] extra: the suite needs it

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(cfg)
    assert ("model.transformer.wte.weight", "model.lm_head.weight") in alias_groups(model)
    load_state(model, None, {k: v.clone() for k, v in state_tensors(model, None).items()})
    untied = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    assert not any("model.lm_head.weight" in g for g in alias_groups(untied))


def test_views_that_share_a_buffer_must_read_back_what_the_state_holds():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.whole = nn.Parameter(torch.arange(8.0))
            self.register_buffer("part", self.whole.data[2:6])  # overlaps whole: not one tensor, one buffer

    model = Views()
    state = {k: v.clone() for k, v in state_tensors(model, None).items()}
    assert alias_groups(model) == []
    load_state(model, None, state)  # honest: the views agree
    state["model.part"][0] = 99.0
    with pytest.raises(VerificationError, match="model.part.*model.whole|model.whole.*model.part"):
        load_state(model, None, state)


def test_a_group_with_a_name_missing_is_refused():
    with pytest.raises(VerificationError, match="holds model.tok.weight but not model.head.weight"):
        check_aliases([TIED], {"model.tok.weight": torch.zeros(2)})


# --- the attack, through the commands a user runs ---------------------------------------------

def test_a_head_swapped_at_the_last_step_is_rejected_by_verify_whatever_the_draw(run, tmp_path, capsys):
    honest, key = run
    final = read_checkpoint(open_bundle(honest).checkpoints[STEPS])
    forged = forge(honest, key, tmp_path / "forged", STEPS, stolen_head(final))
    nonce = nonce_avoiding(forged, STEPS - 1)  # replay never reaches the swap
    args = ["verify", "--allow-weak", "--challenges", "1", "--nonce", nonce]
    assert main([*args, str(honest)]) == 0
    capsys.readouterr()
    assert main([*args, str(forged)]) == 1
    err = capsys.readouterr().err
    assert "REJECTED" in err and "model.tok.weight and model.head.weight" in err and "tied" in err


def test_a_supplied_state_whose_tied_names_differ_is_a_rejected_challenge(run, tmp_path, capsys):
    """The cheap audit: the trainer's response holds the state after 3 updates (no checkpoint) with
    a swapped head, and the log commits it: loading it fails the challenge, naming both names."""
    honest, key = run
    states = trainer_states(honest)
    bad = stolen_head(states[3])
    forged = forge(honest, key, tmp_path / "forged", 3, bad)
    b = open_bundle(forged)
    nonce = next(bytes([i]) for i in range(256)
                 if {c.step for c in draw_challenges(b.final_head, bytes([i]), STEPS, 1)} == {3})
    resp = attacker_response(forged, tmp_path / "resp", {3: bad})
    assert main(["verify", "--allow-weak", str(forged), "--mode", "interactive", "--nonce", nonce.hex(),
                 "--challenges", "1", "--response", str(resp), "--json"]) == 1
    out = capsys.readouterr().out
    assert "step 3: state: the state after 3 update(s) holds different bytes under model.tok.weight and " \
           "model.head.weight" in out


def test_export_and_identify_refuse_a_final_model_whose_tied_names_differ(run, tmp_path, capsys):
    honest, key = run
    assert main(["export", str(honest), "--out", str(tmp_path / "honest.safetensors")]) == 0
    assert main(["identify", str(honest), "--weights", str(tmp_path / "honest.safetensors")]) == 0
    capsys.readouterr()
    final = stolen_head(read_checkpoint(open_bundle(honest).checkpoints[STEPS]))
    forged = forge(honest, key, tmp_path / "forged", STEPS, final)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(forged), "--out", str(out)]) == 1
    assert "model.tok.weight and model.head.weight" in capsys.readouterr().err
    assert not out.exists()
    # the file the trainer would release (its bytes hash to the signed final model hash)
    save_file({k[6:]: v.contiguous() for k, v in final.items() if k.startswith("model.")}, str(out))
    assert main(["identify", str(forged), "--weights", str(out)]) == 1
    assert "model.tok.weight and model.head.weight" in capsys.readouterr().err
