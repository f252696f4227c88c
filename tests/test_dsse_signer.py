"""Who signed a DSSE envelope: a keyid is a hint, never the key. ``data check`` and ``verify-eval``
check the signature against a key the verifier pins (``--signer``, or the run's own key), print the
signer's key, and warn when nothing pins it; a securesystemslib-style keyid (a hash) is read."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from helpers import train_tiny

from witness.cli import main
from witness.commit.dsse import envelope, sslib_keyid, verify_envelope
from witness.commit.signing import generate_key, public_hex, public_key_from_hex, save_key
from witness.errors import MalformedInput, VerificationError


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(map(str, args)))
    out = capsys.readouterr()
    return code, out.out, out.err


def _statement(env_path) -> dict:
    env = json.loads(env_path.read_text())
    return json.loads(base64.b64decode(env["payload"]))


def _write(path, env: dict):
    path.write_text(json.dumps(env))
    return path


def _is_key(hex_key: str) -> bool:
    try:
        public_key_from_hex(hex_key)
        return True
    except MalformedInput:
        return False


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("WARNING")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run signed by the trainer's key, its exclusion proof and evaluation certificate
    (both enveloped, by the trainer's and by a third-party evaluator's key)."""
    d = tmp_path_factory.mktemp("signer")
    trainer, evaluator = generate_key(), generate_key()
    save_key(trainer, d / "trainer.pem")
    save_key(evaluator, d / "evaluator.pem")
    bundle = train_tiny(d / "run", trainer)
    assert main(["data", "exclude", str(bundle), "--text", "never in tiny", "--out", str(d / "exc.json"),
                 "--key", str(d / "trainer.pem")]) == 0
    assert main(["eval", str(bundle), "--out", str(d / "cert.json"), "--key", str(d / "evaluator.pem"),
                 "--quiet"]) == 0
    return d, bundle, public_hex(trainer.public_key()), public_hex(evaluator.public_key()), trainer


# --- (1) a stranger's signature is never silently VALID -----------------------------------------

def test_an_envelope_resigned_by_an_unknown_key_is_not_silently_valid(run, tmp_path, capsys):
    d, bundle, trainer, _, _ = run
    stranger = generate_key()
    stranger_hex = public_hex(stranger.public_key())
    forged = _write(tmp_path / "forged.dsse.json", envelope(_statement(d / "exc.json.dsse.json"), stranger))
    # nothing pinned: the proof inside still checks, but the output names the stranger and warns
    code, out, err = _cli(capsys, "data", "check", forged)
    assert code == 0, err
    first = out.split("\n", 1)[0]
    assert first.startswith("VALID: ") and stranger_hex in first and "which nothing pins" in first, first
    assert json.loads(out.split("\n", 1)[1])["signer_key"] == stranger_hex
    (warning,) = _warnings(err)
    assert stranger_hex in warning and "proves nothing about who made it" in warning and "--signer" in warning
    # the run's key from the bundle: still valid (the proof is the run's), and still a warning
    code, out, err = _cli(capsys, "data", "check", forged, "--bundle", bundle)
    assert code == 0 and stranger_hex in out and "is not the run's key" in _warnings(err)[0], err
    # pinned to the run's key: rejected, naming the key that was expected
    code, out, err = _cli(capsys, "data", "check", forged, "--signer", trainer)
    assert code == 1 and out == "" and not _warnings(err), err
    assert err.startswith("INVALID: ") and trainer in err and "no signature on the envelope" in err, err
    code, out, _ = _cli(capsys, "data", "check", forged, "--signer", trainer, "--json")
    assert code == 1 and json.loads(out)["valid"] is False


def test_an_evaluation_envelope_resigned_by_an_unknown_key(run, tmp_path, capsys):
    d, bundle, trainer, evaluator, _ = run
    stranger = generate_key()
    stranger_hex = public_hex(stranger.public_key())
    forged = _write(tmp_path / "cert.dsse.json", envelope(_statement(d / "cert.json.dsse.json"), stranger))
    code, out, err = _cli(capsys, "verify-eval", forged, "--bundle", bundle, "--spot", "2", "--allow-weak")
    assert code == 0, err
    # who made the certificate is its evaluator (its signature on the certificate is checked); the
    # stranger's envelope only carries it, and says so
    assert out.startswith("ACCEPTED") and f"signed by key {evaluator} (which nothing pins)" in out, out
    (warning,) = _warnings(err)
    assert evaluator in warning and "proves nothing about who made it" in warning
    assert f"envelope is signed by key {stranger_hex}, not by its evaluator" in err
    # pinned to the evaluator's key: the stranger's envelope is refused, naming the key
    code, out, err = _cli(capsys, "verify-eval", forged, "--bundle", bundle, "--spot", "2", "--allow-weak", "--signer", evaluator)
    assert code == 1 and "no signature on the envelope by the expected key" in err and evaluator in err, err
    assert not _warnings(err)


def test_an_evaluators_certificate_rewrapped_under_the_runs_key_is_not_pinned_by_it(run, tmp_path, capsys):
    """The red team: the trainer wraps a third party's certificate in an envelope of the run's own key.
    The run's key pins the envelope, not the certificate's maker, which nothing pins: a WARNING."""
    d, bundle, trainer, evaluator, trainer_key = run
    rewrapped = _write(tmp_path / "cert.dsse.json", envelope(_statement(d / "cert.json.dsse.json"), trainer_key))
    code, out, err = _cli(capsys, "verify-eval", rewrapped, "--bundle", bundle, "--spot", "2", "--allow-weak")
    assert code == 0 and f"signed by key {evaluator} (which nothing pins)" in out, out
    assert evaluator in _warnings(err)[0] and f"envelope is signed by key {trainer}" in err
    # witness report names the maker and warns the same way
    code, _, err = _cli(capsys, "report", bundle, "--out", tmp_path / "report", "--eval", rewrapped, "--spot", "2")
    assert code == 0 and evaluator in _warnings(err)[0], err
    assert f"signed by key {evaluator} (which nothing pins)" in (tmp_path / "report" / "report.md").read_text()


# --- (2) a securesystemslib keyid (a hash) is read, never parsed as a key -------------------------

def test_sslib_keyid_is_the_hash_of_the_canonical_key():
    key = "d7" * 32
    # securesystemslib's default keyid: SHA-256 of {"keytype", "keyval": {"public"}, "scheme"} in canonical JSON
    want = hashlib.sha256(b'{"keytype":"ed25519","keyval":{"public":"' + key.encode() + b'"},"scheme":"ed25519"}')
    assert sslib_keyid(key) == want.hexdigest()


@pytest.mark.parametrize("keyid", ["sslib", "", None])
def test_an_envelope_with_a_hash_keyid_verifies_and_names_its_signer(run, tmp_path, capsys, keyid):
    d, bundle, trainer, _, _ = run
    env = json.loads((d / "exc.json.dsse.json").read_text())
    sig = env["signatures"][0]
    if keyid is None:  # DSSE: the keyid is optional
        del sig["keyid"]
    else:
        sig["keyid"] = sslib_keyid(trainer) if keyid == "sslib" else keyid
    path = _write(tmp_path / "sslib.dsse.json", env)
    # pinned with --signer: verifies, and says by whom
    code, out, err = _cli(capsys, "data", "check", path, "--signer", trainer)
    assert code == 0, err
    assert f"signed by key {trainer} (pinned by --signer)" in out.split("\n", 1)[0] and not _warnings(err)
    # the bundle's own key pins it too
    code, out, err = _cli(capsys, "data", "check", path, "--bundle", bundle)
    assert code == 0 and f"signed by key {trainer} (pinned by the run's key)" in out and not _warnings(err), err
    # nothing pinned: the key the proof itself names verifies it, reported with a warning
    code, out, err = _cli(capsys, "data", "check", path)
    assert code == 0 and trainer in out and trainer in _warnings(err)[0], err
    # a public key file works as --signer too
    code, _, err = _cli(capsys, "data", "check", path, "--signer", d / "trainer.pub")
    assert code == 0, err


def test_an_evaluation_envelope_with_a_hash_keyid(run, tmp_path, capsys):
    d, bundle, _, evaluator, _ = run
    env = json.loads((d / "cert.json.dsse.json").read_text())
    env["signatures"][0]["keyid"] = sslib_keyid(evaluator)
    path = _write(tmp_path / "cert.dsse.json", env)
    code, out, err = _cli(capsys, "verify-eval", path, "--bundle", bundle, "--spot", "2", "--allow-weak", "--signer", evaluator)
    assert code == 0 and f"signed by key {evaluator} (pinned by --signer)" in out and not _warnings(err), (out, err)
    code, out, _ = _cli(capsys, "verify-eval", path, "--bundle", bundle, "--spot", "2", "--allow-weak", "--signer", evaluator,
                        "--json")
    verdict = json.loads(out)
    assert code == 0 and verdict["signer_key"] == evaluator and verdict["signer_pinned_by"] == "--signer"


def test_no_key_to_check_with_is_unusable_input_not_a_crash(run, tmp_path, capsys):
    d = run[0]
    stmt = _statement(d / "exc.json.dsse.json")
    del stmt["predicate"]["public_key"]  # a Statement that names no key ...
    env = envelope(stmt, generate_key())
    # ... and a keyid that is none. About one hash in sixteen decodes as a good Ed25519 key (a point of the
    # prime-order subgroup), which is then tried, fails, and makes this a rejection instead: pick a key
    # whose securesystemslib keyid is no key, so the test means the same on every run
    keyid = next(k for k in (sslib_keyid(public_hex(generate_key().public_key())) for _ in range(1000))
                 if not _is_key(k))
    env["signatures"][0]["keyid"] = keyid
    code, out, err = _cli(capsys, "data", "check", _write(tmp_path / "nokey.dsse.json", env))
    assert code == 2 and out == "" and err.startswith("UNUSABLE INPUT: ") and "--signer" in err, err
    assert "point" not in err
    # a hash keyid that happens to decode as a good key is tried as one: it does not verify, a rejection
    keyid = next(k for k in (sslib_keyid(public_hex(generate_key().public_key())) for _ in range(1000)) if _is_key(k))
    env["signatures"][0]["keyid"] = keyid
    code, out, err = _cli(capsys, "data", "check", _write(tmp_path / "haskey.dsse.json", env))
    assert code == 1 and "signature is invalid" in err, err


def test_a_weak_pinned_key_is_refused(run, capsys):
    d = run[0]
    code, _, err = _cli(capsys, "data", "check", d / "exc.json.dsse.json", "--signer", "00" * 32)
    assert code == 2 and "bad public key" in err, err


# --- (3) the honest path: valid, and says who signed ----------------------------------------------

def test_the_honest_path_prints_its_signer(run, capsys):
    d, bundle, trainer, evaluator, _ = run
    for proof in ("exc.json.dsse.json", "exc.json"):
        code, out, err = _cli(capsys, "data", "check", d / proof, "--bundle", bundle)
        assert code == 0 and f"signed by key {trainer} (pinned by the run's key)" in out and not _warnings(err), err
        code, out, err = _cli(capsys, "data", "check", d / proof, "--signer", trainer)
        assert code == 0 and f"signed by key {trainer} (pinned by --signer)" in out and not _warnings(err), err
    code, out, err = _cli(capsys, "data", "check", d / "exc.json.dsse.json", "--json")
    summary = json.loads(out)
    assert code == 0 and summary["signer_key"] == trainer and summary["signer_pinned"] is False
    assert trainer in _warnings(err)[0]
    # an evaluation by a third party: its key is printed; pinned, no warning; unpinned, a warning
    for cert in ("cert.json.dsse.json", "cert.json"):
        code, out, err = _cli(capsys, "verify-eval", d / cert, "--bundle", bundle, "--spot", "2", "--allow-weak", "--signer",
                              evaluator)
        assert code == 0 and f"signed by key {evaluator} (pinned by --signer)" in out and not _warnings(err), err
        code, out, err = _cli(capsys, "verify-eval", d / cert, "--bundle", bundle, "--spot", "2", "--allow-weak")
        assert code == 0 and evaluator in out and evaluator in _warnings(err)[0], err
        # the trainer's key does not stand in for the evaluator's
        code, _, err = _cli(capsys, "verify-eval", d / cert, "--bundle", bundle, "--spot", "2", "--allow-weak", "--signer", trainer)
        assert code == 1 and trainer in err, err


def test_the_library_reports_whether_the_signer_is_trusted(run):
    d, _, trainer, _, _ = run
    env = json.loads((d / "exc.json.dsse.json").read_text())
    assert verify_envelope(env, trusted=[trainer]).trusted
    unpinned = verify_envelope(env)
    assert unpinned.signer == trainer and not unpinned.trusted
    other = public_hex(generate_key().public_key())
    with pytest.raises(VerificationError, match="expected key"):
        verify_envelope(env, pinned=other)
    with pytest.raises(MalformedInput):
        verify_envelope(dict(env, extra=1))
    with pytest.raises(MalformedInput):
        verify_envelope(dict(env, signatures=env["signatures"] * 17))
