"""Structurally wrong inputs (every field replaced by junk) raise a VerificationError, never a crash."""

from __future__ import annotations

import copy
import json

import pytest
from helpers import train_tiny

from witness.commit.signing import generate_key
from witness.errors import VerificationError
from witness.evals.certificate import check_certificate, sign_certificate
from witness.evals.evaluate import evaluate, verify_eval
from witness.task import build_task
from witness.verify.data_queries import check_data_proof as check_proof
from witness.verify.data_queries import run_commitments

JUNK = [None, 1, -1, "x", "ab" * 32, [], {}, [1, 2], {"a": 1}, True, 1.5]


def _paths(obj, prefix=()):
    """Every path to a value inside nested dicts (lists: their first element)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list) and obj:
        yield (*prefix, 0)
        yield from _paths(obj[0], (*prefix, 0))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _mutants(doc, limit_paths=400):
    for path in list(_paths(doc))[:limit_paths]:
        original = _get(doc, path)
        for junk in JUNK:
            if type(junk) is type(original) and junk == original:
                continue  # not a change
            m = copy.deepcopy(doc)
            _set(m, path, junk)
            yield path, m


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("garbage")
    bundle = train_tiny(d / "run", config={"steps": 12})
    run, task = run_commitments(bundle)
    from witness.data.proofs import prove_exclusion, prove_inclusion

    used = run.usage.documents.values[0]
    absent = b"\x01" * 32
    key = generate_key()
    cert = evaluate(bundle, key, progress=False)
    return prove_inclusion(run, used), prove_exclusion(run, absent), cert, key, bundle


def _must_fail(check, path) -> None:
    try:
        check()
    except VerificationError:
        return
    raise AssertionError(f"a proof with {path} replaced by junk still checks")


def test_mutated_data_proofs_raise_verification_errors(artefacts):
    for proof in artefacts[:2]:
        check_proof(proof)
        for path, m in _mutants(proof):
            _must_fail(lambda m=m: check_proof(json.loads(json.dumps(m))), path)


# Fields that only the bundle can judge (the evaluation split's root, size and documents, the task): checked
# by verify_eval against it, not by check_certificate alone.
BUNDLE_CHECKED = {("task",), ("eval_set", "root"), ("eval_set", "size"), ("contamination", "documents")}


def test_mutated_certificates_raise_verification_errors(artefacts):
    aggregates = build_task("tiny").aggregates
    cert, key, bundle = artefacts[2], artefacts[3], artefacts[4]
    body = {k: v for k, v in cert.items() if k not in ("signature", "evaluator")}
    check_certificate(sign_certificate(body, key), aggregates)  # the unmutated certificate checks
    checked = 0
    for path, m in _mutants(body):
        if path[0] == "near_duplicates" or path[-1] == "name":
            continue  # information only: signed, but not part of the claim
        # Re-signed, so that the parser itself (not the signature) must catch the junk.
        signed = sign_certificate(m, key)
        if path in BUNDLE_CHECKED:
            _must_fail(lambda s=signed: verify_eval(s, bundle, spots=1), path)
        else:
            _must_fail(lambda s=signed: check_certificate(s, aggregates), path)
        checked += 1
    assert checked > 300


def test_mutated_responses_are_unusable_input_not_crashes(tmp_path):
    from witness.commit.hashing import canonical_json
    from witness.errors import MalformedInput
    from witness.verify.respond import respond
    from witness.verify.response import Response

    bundle = train_tiny(tmp_path / "run", config={"steps": 8}, checkpoint_every=4)
    respond(bundle, tmp_path / "resp", nonce=b"n", challenges=1)
    doc = json.loads((tmp_path / "resp" / "response.json").read_text())
    Response(tmp_path / "resp")
    for path, m in _mutants(doc):
        (tmp_path / "resp" / "response.json").write_bytes(canonical_json(m))
        try:
            Response(tmp_path / "resp")
        except MalformedInput:
            continue  # refused while parsing
        # Parsed: what it names must still be refused or checked later, never crash here.
        assert path[0] in ("states", "steps", "head_root", "head_size"), path


def test_mutated_used_data_proofs_are_refused_not_crashes(tmp_path, monkeypatch):
    # A run as witness 0.4 recorded it (no committed leaves): its response proves every sample in the
    # used-data trees, and every mutation of those proofs is refused.
    from witness.commit.hashing import canonical_json
    from witness.errors import RunRejected
    from witness.verify import Evidence, Policy, Verifier
    from witness.verify.respond import respond

    monkeypatch.setattr("witness.record.start.DATA_COMMITMENT", 1)
    bundle = train_tiny(tmp_path / "run", config={"steps": 8}, checkpoint_every=4)
    monkeypatch.undo()
    respond(bundle, tmp_path / "resp", nonce=b"n", challenges=1)
    doc = json.loads((tmp_path / "resp" / "response.json").read_text())
    Verifier(policy=Policy(challenges=1, nonce=b"n", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp"))
    (step,) = doc["steps"]
    tried = 0
    for path, m in _mutants({"used": doc["steps"][step]["used"]}):
        full = copy.deepcopy(doc)
        full["steps"][step]["used"] = m["used"]
        (tmp_path / "resp" / "response.json").write_bytes(canonical_json(full))
        with pytest.raises(VerificationError) as info:  # unusable, or a failed challenge: never a crash
            Verifier(policy=Policy(challenges=1, nonce=b"n", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp"))
        if isinstance(info.value, RunRejected):
            assert "used-" in info.value.failures[0] or "used-data" in info.value.failures[0], path
        tried += 1
    assert tried > 50


def test_a_response_to_a_run_with_committed_leaves_carries_no_proofs(tmp_path):
    # Its samples are checked against the dataset's leaves: proofs where none belong are refused.
    from witness.commit.hashing import canonical_json
    from witness.errors import MalformedInput
    from witness.verify import Evidence, Policy, Verifier
    from witness.verify.respond import respond

    bundle = train_tiny(tmp_path / "run", config={"steps": 8}, checkpoint_every=4)
    respond(bundle, tmp_path / "resp", nonce=b"n", challenges=1)
    doc = json.loads((tmp_path / "resp" / "response.json").read_text())
    Verifier(policy=Policy(challenges=1, nonce=b"n", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp"))
    (step,) = doc["steps"]
    assert doc["steps"][step]["used"] is None and all(p == [] for p in doc["steps"][step]["proofs"])
    tried = 0
    for field, junk in [("used", j) for j in JUNK if j is not None] + [("proofs", [["ab" * 32]] * 16)]:
        full = copy.deepcopy(doc)
        full["steps"][step][field] = junk
        (tmp_path / "resp" / "response.json").write_bytes(canonical_json(full))
        with pytest.raises(MalformedInput):
            Verifier(policy=Policy(challenges=1, nonce=b"n", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp"))
        tried += 1
    assert tried == len(JUNK)
