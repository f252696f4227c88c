"""Malicious bundles and responses: a clear error and exit code 2, never a crash or an unpickle."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
from helpers import nonce_drawing_elsewhere

from witness.bundle.layout import MAX_LOG_BYTES
from witness.cli import main
from witness.errors import MalformedInput
from witness.verify import Evidence, Policy, Verifier
from witness.verify.respond import respond


class Boom:
    """Unpickling this would run code."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/witness-pwned",))


def _exit(bundle, *extra) -> int:
    return main(["verify", "--allow-weak", str(bundle), "--challenges", "1", "--json", *extra])


def test_pickle_file_in_the_bundle(bundle_copy, capsys):
    (bundle_copy / "checkpoints" / "optimizer.pt").write_bytes(pickle.dumps(Boom()))
    assert _exit(bundle_copy) == 2
    assert "pickle" in capsys.readouterr().err
    assert not os.path.exists("/tmp/witness-pwned")


def test_pickle_disguised_as_a_checkpoint(bundle_copy, capsys):
    (bundle_copy / "checkpoints" / "00000020.safetensors").write_bytes(pickle.dumps(Boom()))
    assert _exit(bundle_copy) == 2
    assert "looks like a pickle" in capsys.readouterr().err
    assert not os.path.exists("/tmp/witness-pwned")


def test_link_that_leaves_the_bundle(bundle_copy, capsys):
    target = bundle_copy / "checkpoints" / "00000020.safetensors"
    target.unlink()
    target.symlink_to("/etc/passwd")
    assert _exit(bundle_copy) == 2
    assert "a bundle may not point outside itself" in capsys.readouterr().err


def test_unknown_file_and_folder(bundle_copy, capsys):
    (bundle_copy / "notes.txt").write_text("hi")
    assert _exit(bundle_copy) == 2
    assert "unexpected file notes.txt" in capsys.readouterr().err
    (bundle_copy / "notes.txt").unlink()
    (bundle_copy / "..hidden").mkdir()
    assert _exit(bundle_copy) == 2


@pytest.mark.parametrize("alias", ["000000020", "0000000020", "000000000020"])
def test_an_alias_checkpoint_is_refused(bundle_copy, capsys, alias):
    # the real file's exact bytes under another zero-padding of the same step: a second file for
    # one committed state, which the reader's map would have let shadow the first
    real = bundle_copy / "checkpoints" / "00000020.safetensors"
    shutil.copyfile(real, bundle_copy / "checkpoints" / f"{alias}.safetensors")
    assert _exit(bundle_copy) == 2
    assert f"unexpected file checkpoints/{alias}.safetensors" in capsys.readouterr().err


def test_oversized_log(bundle_copy, capsys):
    with open(bundle_copy / "log.jsonl", "r+b") as f:
        f.truncate(MAX_LOG_BYTES + 1)  # sparse: costs no disk, and must be refused before reading
    assert _exit(bundle_copy) == 2
    assert "over the" in capsys.readouterr().err


def test_oversized_safetensors_header(bundle_copy, capsys):
    path = bundle_copy / "checkpoints" / "00000020.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    assert _exit(bundle_copy) in (1, 2)
    err = capsys.readouterr().err
    assert "00000020.safetensors" in err


@pytest.mark.parametrize("name,cut", [("bundle.json", 10), ("heads.jsonl", -30), ("log.jsonl", 300)])
def test_truncated_json(bundle_copy, capsys, name, cut):
    path = bundle_copy / name
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    assert _exit(bundle_copy) == 2
    err = capsys.readouterr().err
    assert "UNUSABLE INPUT" in err and (name in err or "manifest" in err or "truncated" in err)


def test_missing_bundle_is_unusable(tmp_path, capsys):
    assert _exit(tmp_path / "nope") == 2
    assert "does not exist" in capsys.readouterr().err


def test_response_naming_a_path_outside(honest_bundle, tmp_path):
    resp = tmp_path / "resp"
    respond(honest_bundle, resp, nonce=b"n", challenges=2)
    doc = (resp / "response.json").read_text()
    first = doc.split('"states":{"', 1)[1].split('"', 1)[0]
    evil = doc.replace(f'"states/{int(first):08d}.safetensors"', '"../../../../etc/passwd"')
    (resp / "response.json").write_text(evil)
    with pytest.raises(MalformedInput, match="outside its states/ folder"):
        Verifier(policy=Policy(challenges=2, nonce=b"n", mode="interactive")).verify(honest_bundle, Evidence(response=resp))


def test_response_with_a_linked_state(honest_bundle, tmp_path):
    resp = tmp_path / "resp"
    respond(honest_bundle, resp, nonce=b"n", challenges=1)
    state = next((resp / "states").iterdir())
    state.unlink()
    state.symlink_to(honest_bundle / "checkpoints" / "00000010.safetensors")
    with pytest.raises(MalformedInput, match="link"):
        Verifier(policy=Policy(challenges=1, nonce=b"n", mode="interactive")).verify(honest_bundle, Evidence(response=resp))


def test_cli_exit_codes_in_a_fresh_process(honest_bundle, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "witness.cli", "verify", "--allow-weak", str(honest_bundle), "--challenges", "2"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "b"
    shutil.copytree(honest_bundle, bad)
    (bad / "checkpoints" / "x.pkl").write_bytes(b"\x80\x04.")
    res = subprocess.run([sys.executable, "-m", "witness.cli", "verify", "--allow-weak", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2 and "pickle" in res.stderr


def test_a_run_stopped_before_its_first_checkpoint_is_unusable_not_rejected(tmp_path, capsys):
    from witness.commit.signing import generate_key
    from witness.record import Commitments, Recorder
    from witness.task import build_task

    task = build_task("tiny", {"steps": 20})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x01" * 32,
                          commit=Commitments(checkpoint_every=10))
    for t in range(3):  # killed here: three steps logged, none under a signed head yet
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    assert _exit(tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("UNUSABLE INPUT") and "stopped before its first checkpoint" in err and "--resume" in err


def test_responses_answer_the_audit_nonce_and_carry_none(honest_bundle, tmp_path):
    from witness.commit.hashing import canonical_json, parse_canonical_json
    from witness.errors import RunRejected
    from witness.verify.response import Response

    resp = tmp_path / "resp"
    respond(honest_bundle, resp, nonce=b"n", challenges=2)
    doc = parse_canonical_json((resp / "response.json").read_bytes())
    assert "nonce" not in doc
    # made for another nonce: the states this audit draws are missing, and the verdict says why
    with pytest.raises(RunRejected, match="this audit's nonce"):
        Verifier(policy=Policy(challenges=2, nonce=nonce_drawing_elsewhere(honest_bundle, b"n", 2), mode="interactive")).verify(honest_bundle, Evidence(response=resp))
    # a version 2 response (with its unchecked nonce) is not read
    (resp / "response.json").write_bytes(canonical_json(dict(doc, version=2, nonce="6e")))
    with pytest.raises(MalformedInput, match="supported version"):
        Response(resp)
