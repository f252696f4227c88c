"""Every manifest field is enforced: each one set to a false value (and the log re-signed, as a
trainer holding its key can) is refused, as a rejection or as unusable input, with a clear reason."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import edit_manifest, train_tiny

from witness.bundle.reader import open_bundle
from witness.bundle.schema import Manifest
from witness.commit.signing import generate_key, public_hex
from witness.errors import MalformedInput, VerificationError
from witness.verify import Policy, Trust, Verifier

REJECTED, UNUSABLE = 1, 2


def _spec(m: dict) -> dict:
    return dict(m["fingerprint_spec"], probes=9)


# field -> (false value, or a function of the honest manifest; exit code; what the refusal says)
FALSE_VALUES = {
    "type": ("step", UNUSABLE, "first record must be the manifest"),
    "format_version": (1, UNUSABLE, "unsupported manifest version"),
    "task": ("tinygpt", REJECTED, "not a registered one"),
    "task_config": (lambda m: dict(m["task_config"], lr=0.02), REJECTED, "learning rate"),
    "code_version": ("0.1.0", UNUSABLE, "recorded by witness 0.1.0"),
    "r": ("11" * 32, REJECTED, r"run seed is not H\(data root \|\| r\)"),
    "r_source": ("ticket", REJECTED, "not derived from the ticket"),  # the issuer's ticket was another r
    "run_seed": ("00" * 32, REJECTED, r"run seed is not H\(data root \|\| r\)"),
    "data_root": ("00" * 32, REJECTED, r"run seed is not H\(data root \|\| r\)"),
    "dataset_size": (1000, UNUSABLE, "committed dataset"),
    "probe_hash": ("00" * 32, REJECTED, "committed probe set is not the task's"),
    "fingerprint_spec": (_spec, REJECTED, "fingerprint spec is not the task's"),
    "checkpoint_every": (20, REJECTED, "the record adds a checkpoint"),
    "state_every": (2, REJECTED, "the record adds a state hash"),
    "state_digest": ("sha256", REJECTED, "initial state is not the one the run seed generates"),
    "steps_planned": (41, REJECTED, "steps_planned disagrees with the recipe"),
    "world_size": (2, REJECTED, "replay"),  # with parallelism ddp: two micro-batches are not one batch
    "parallelism": ("tp", UNUSABLE, "parallelism must be none, ddp or fsdp"),
    "threads": (1, REJECTED, "replay: replayed"),  # replayed at the claimed count: other bits
    "versions": ({"torch": "2.0.0"}, UNUSABLE, "torch 2.0.0"),
    "public_key": (public_hex(generate_key().public_key()), REJECTED, "signature"),
    "init_state_hash": ("00" * 32, REJECTED, "initial state is not the one the run seed generates"),
    "init_checkpoint_sha256": ("00" * 32, REJECTED, "is not the committed checkpoint file"),
}


def test_the_table_covers_every_manifest_field():
    assert set(FALSE_VALUES) == Manifest.FIELDS


@pytest.fixture(scope="module")
def honest(tmp_path_factory, signing_key):
    d = tmp_path_factory.mktemp("fields")
    tiny = train_tiny(d / "tiny", signing_key)
    # the thread count matters only where a kernel depends on it: tinycnn's first convolution
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cnn = train_tiny(d / "cnn", signing_key, task="tinycnn", config={"steps": 8}, checkpoint_every=4)
    finally:
        torch.set_num_threads(before)
    assert open_bundle(cnn).manifest.threads == 2
    return {"tiny": tiny, "cnn": cnn}


@pytest.mark.parametrize("field", sorted(FALSE_VALUES))
def test_a_false_manifest_field_is_refused(honest, signing_key, tmp_path, field):
    value, code, why = FALSE_VALUES[field]
    source = honest["cnn" if field == "threads" else "tiny"]
    bundle = tmp_path / "b"
    shutil.copytree(source, bundle)
    m = open_bundle(source).manifest.raw
    changes = {field: value(m) if callable(value) else value}
    if field == "world_size":
        changes["parallelism"] = "ddp"
    edit_manifest(bundle, signing_key, **changes)
    ticket = b"\x08" * 32 if field == "r_source" else None
    with pytest.raises(VerificationError, match=why) as info:
        Verifier(Trust(ticket=ticket), Policy(challenges=10_000, nonce=b"f")).verify(bundle)
    assert info.value.exit_code == code, str(info.value)
    assert isinstance(info.value, MalformedInput) == (code == UNUSABLE)


def test_a_true_ticket_claim_passes_and_is_reported(honest, signing_key, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(honest["tiny"], bundle)
    edit_manifest(bundle, signing_key, r_source="ticket")
    v = Verifier(Trust(ticket=b"\x07" * 32), Policy(challenges=3)).verify(bundle)
    assert "r is the issued ticket" in v.checks
    v = Verifier(policy=Policy(challenges=3)).verify(bundle)
    assert any("only its issuer can check" in n for n in v.notes)
