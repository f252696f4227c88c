"""Data usage is exact in every mode: the task decides what a document is, and every batch root and
both used-data trees are rebuilt from the dataset's committed leaves, by hashing alone.

Every attack is mounted by a dishonest trainer with the project's own recorder and its own key:
its end record (and the final head, which signs the same fields) claims what suits it.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from attacks import GPT
from fastapi.testclient import TestClient
from helpers import log_lines, resign, resign_certificate, train_tiny
from lbhelpers import Authed, make_settings, register

from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.signing import generate_key
from witness.commit.sorted_tree import SortedTree
from witness.data.dataset import batch_root
from witness.data.leaves import DatasetLeaves
from witness.data.proofs import RunCommitments, prove_exclusion
from witness.data.stdlib import StdlibWindows
from witness.data.usage import UsageCommitment, usage_json
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.evals.certificate import build_body, sign_certificate
from witness.evals.evaluate import verify_eval
from witness.leaderboard import client as C
from witness.leaderboard.app import create_app
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work
from witness.task import build_task
from witness.verify import Evidence, Policy, Verifier
from witness.verify.data_queries import check_data_proof, run_commitments
from witness.verify.respond import respond

ALL = 10_000
SWAP = "gives documents under rule 'self', but the task 'tinygpt' decides rule 'prefix32'"


def _interactive(bundle, resp, nonce=b"r", challenges=ALL, leaves=None):
    policy = Policy(challenges=challenges, nonce=nonce, mode="interactive")
    return Verifier(policy=policy).verify(bundle, Evidence(response=resp, leaves=leaves))


def _both_modes(bundle, tmp_path):
    offline = Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    respond(bundle, tmp_path / "resp", nonce=b"r", challenges=ALL)
    return offline, _interactive(bundle, tmp_path / "resp")


# --- honest runs: 0 false rejections ------------------------------------------------------------

@pytest.mark.parametrize("task,config", [("tiny", {"steps": 12}), ("tinycnn", {"steps": 8}),
                                         ("tinygpt", dict(GPT, steps=6)), ("example-cnn", {"steps": 8})])
def test_honest_runs_of_every_task_are_accepted_in_both_modes(tmp_path, task, config):
    bundle = train_tiny(tmp_path / "b", task=task, config=config, checkpoint_every=4)
    steps = config["steps"]
    rule = build_task(task, config).document_rule
    assert (bundle / "dataset.leaves").exists()
    for v in _both_modes(bundle, tmp_path):
        assert v.accepted and v.exact and v.replayed_steps == steps
        assert f"batch roots of all {steps} steps recomputed from the dataset's committed leaves" in v.checks
        assert f"used-sample and used-document trees rebuilt from all {steps} batches (the dataset's committed " \
               f"leaves, rule {rule!r})" in v.checks
    # the cheap audit needs no data: it passes with the leaves file alone, here or beside the bundle
    shutil.move(bundle / "dataset.leaves", tmp_path / "published.leaves")
    with pytest.raises(MalformedInput, match="needs the dataset's leaves"):
        _interactive(bundle, tmp_path / "resp")
    assert _interactive(bundle, tmp_path / "resp", leaves=tmp_path / "published.leaves").accepted
    assert Verifier(policy=Policy(challenges=2)).verify(bundle).accepted  # offline, the dataset here gives them


# --- 1. the task, never the bundle, decides what a document is ---------------------------------

def _window_trees(bundle_dir) -> tuple[SortedTree, SortedTree]:
    """What a trainer claiming rule 'self' commits: every used window is its own document."""
    b = open_bundle(bundle_dir)
    ds = build_task(b.manifest.task, b.manifest.task_config).dataset()
    used = SortedTree(ds.hashes[i] for r in b.steps for i in r.batch)
    return used, used


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """An honest tinygpt run whose end record and final head claim rule 'self', with a used-document
    tree of the windows' own hashes, signed by the trainer: every training file is then 'absent'."""
    d = tmp_path_factory.mktemp("swap")
    key = generate_key()
    bundle = train_tiny(d / "b", key, task="tinygpt", config=dict(GPT, steps=8), checkpoint_every=4)
    shutil.copytree(bundle, d / "honest")
    respond(bundle, d / "resp", nonce=b"r", challenges=ALL)  # the honest answers: every step replays
    samples, documents = _window_trees(bundle)
    lines = log_lines(bundle)
    end = parse_canonical_json(lines[-1])
    end |= usage_json("self", (samples.root, samples.size), (documents.root, documents.size))
    resign(bundle, key, lines[:-1] + [canonical_json(end)])
    return d, bundle, key, samples


def test_a_document_rule_swap_is_rejected_by_the_cheap_audit_and_offline(swapped):
    d, bundle, _, _ = swapped
    for mode in ("interactive", "offline"):  # before any replay: whatever the challenges
        with pytest.raises(VerificationError, match=SWAP) as info:
            Verifier(policy=Policy(challenges=ALL, nonce=b"r", mode=mode)).verify(bundle, Evidence(response=d / "resp"))
        assert not isinstance(info.value, RunRejected)
    assert main(["verify", "--allow-weak", str(bundle), "--mode", "interactive", "--response", str(d / "resp"), "--nonce", "72"]) == 1


def test_a_document_rule_swap_cannot_prove_a_trained_file_absent(swapped, tmp_path, capsys):
    _, bundle, _, samples = swapped
    b = open_bundle(bundle)
    task = build_task(b.manifest.task, b.manifest.task_config)
    ds = task.dataset()
    trained = ds.leaves.documents(b.steps[0].batch[0])[0]  # a source file the run trained on
    swapped_usage = UsageCommitment(samples, samples, "self")
    run = RunCommitments(b.manifest.public_key, b.final_head, b.log, b.end.raw, [r.raw for r in b.steps], ds,
                         swapped_usage)
    proof = prove_exclusion(run, trained)  # what the trainer hands out: "this file was never used"
    for pin in ({}, {"head": b.final_head, "public_key": b.manifest.public_key}, {"task": task}):
        with pytest.raises(VerificationError, match="decides rule 'prefix32'"):
            check_data_proof(proof, **pin)
    (tmp_path / "p.json").write_bytes(canonical_json(proof))
    assert main(["data", "check", str(tmp_path / "p.json")]) == 1
    assert main(["data", "check", str(tmp_path / "p.json"), "--bundle", str(bundle)]) == 1
    assert "decides rule 'prefix32'" in capsys.readouterr().err
    with pytest.raises(VerificationError, match=SWAP):  # nor can witness's own tools build one
        run_commitments(bundle)


def test_a_document_rule_swap_cannot_carry_a_contamination_certificate(swapped):
    """The trainer forges a certificate of one example (this small corpus holds out no evaluation file, and a
    certificate of none certifies nothing) under the swapped head: the rule swap is caught first."""
    d, bundle, key, samples = swapped
    b = open_bundle(bundle)
    example = {"index": 0, "sample": "00" * 32, "loss": 1.0}
    aggregates = build_task("tinygpt", b.manifest.task_config).aggregates([example])
    cert = sign_certificate(build_body("tinygpt", b.final_head, b.manifest.public_key, (b"\x01" * 32, 1), [example],
                                       aggregates, [], {}), key)
    forged = resign_certificate(cert, key)
    with pytest.raises(VerificationError, match="decides rule 'prefix32'"):
        verify_eval(forged, bundle, spots=1)


def test_a_document_rule_swap_is_rejected_by_the_leaderboard(tmp_path, monkeypatch):
    track = parse_track("gpt=tinygpt:" + ",".join(f"{k}={json.dumps(v)}" for k, v in dict(GPT, steps=4).items())
                        + "@mean_loss-")
    lb = Leaderboard(make_settings("sqlite", tmp_path, tracks=(track,)))
    with TestClient(create_app(lb=lb)) as tc:
        alice = register(tc, "alice")
        # the trainer's recorder signs (and streams) a final head that claims rule 'self'
        import witness.record.recorder as recorder

        def self_rule(leaves, batches):
            batches = list(batches)
            hashes = {leaves.sample_hash(i) for b in batches for i in b}
            tree = SortedTree(hashes)
            return usage_json("self", (tree.root, tree.size), (tree.root, tree.size))

        monkeypatch.setattr(recorder, "used_roots", self_rule)
        run_id, _ = C.train_ticketed(Authed(tc, alice.token), "gpt", alice.key, tmp_path / "run",
                                     C.TicketedRun(checkpoint_every=2))
        monkeypatch.undo()
        (tmp_path / "eval.json").write_text("{}")
        C.submit(Authed(tc, alice.token), tmp_path / "run", tmp_path / "eval.json")
        assert work(lb, once=True) == 1
        r = tc.get(f"/api/runs/{run_id}").json()
        assert r["status"] == "rejected" and SWAP in r["reason"], r["reason"]
    lb.engine.dispose()


# --- 2 and 3. used-data trees with a document added or left out --------------------------------

def _claim(bundle, key, documents: SortedTree | None = None, samples: SortedTree | None = None):
    lines = log_lines(bundle)
    end = parse_canonical_json(lines[-1])
    if documents is not None:
        end["used_documents"] = {"root": documents.root.hex(), "size": documents.size}
    if samples is not None:
        end["used_samples"] = {"root": samples.root.hex(), "size": samples.size}
    resign(bundle, key, lines[:-1] + [canonical_json(end)])


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    key = generate_key()
    bundle = train_tiny(d / "b", key, task="tinygpt", config=dict(GPT, steps=8), checkpoint_every=4)
    respond(bundle, d / "resp", nonce=b"r", challenges=ALL)
    run, _ = run_commitments(bundle)
    return d, bundle, key, run


@pytest.mark.parametrize("change", ["added", "left out"])
def test_a_used_document_tree_that_adds_or_leaves_out_a_document_is_rejected_whatever_is_drawn(gpt_run, tmp_path, change):
    d, honest, key, run = gpt_run
    bundle = tmp_path / "b"
    shutil.copytree(honest, bundle)
    used = list(run.usage.documents.values)
    if change == "added":  # a file never trained on, now "used": an inclusion claim with nothing behind it
        never = next(h for _, h, _ in run.dataset.documents_list() if h not in run.usage.documents)
        _claim(bundle, key, documents=SortedTree([*used, never]))
        why = "used-document tree .* adds data the run never trained on"
    else:  # a file the run trained on, now "absent"
        _claim(bundle, key, documents=SortedTree(used[1:]))
        why = "used-document tree .* leaves out data the run trained on"
    resp = d / "resp"
    for nonce in (b"a", b"b", b"c"):  # one challenge each, wherever it falls
        with pytest.raises(VerificationError, match=why) as info:
            _interactive(bundle, resp, nonce=nonce, challenges=1)
        assert not isinstance(info.value, RunRejected)  # no replay was needed


# --- 4. a record whose batch root names other leaves: caught at every step ---------------------

def test_a_batch_root_naming_other_leaves_is_caught_at_every_step(gpt_run, tmp_path):
    d, honest, key, run = gpt_run
    steps = len(open_bundle(honest).steps)
    n = len(run.dataset)
    for t in range(steps):
        bundle = tmp_path / f"b{t}"
        shutil.copytree(honest, bundle)
        lines = log_lines(bundle)
        rec = parse_canonical_json(lines[t + 1])
        other = [(i + 1) % n for i in rec["batch"]]  # the neighbouring windows: other leaves of the dataset
        rec["batch_root"] = batch_root([run.dataset.hashes[i] for i in other]).hex()
        lines[t + 1] = canonical_json(rec)
        resign(bundle, key, lines)
        with pytest.raises(VerificationError, match=f"step {t}: data: the batch root is not that of the committed samples"):
            _interactive(bundle, d / "resp", nonce=b"x", challenges=1)


# --- the leaves themselves ---------------------------------------------------------------------

def test_a_leaves_file_that_is_not_the_committed_dataset_is_refused(gpt_run, tmp_path):
    d, honest, key, run = gpt_run
    bundle = tmp_path / "b"
    shutil.copytree(honest, bundle)
    raw = bytearray((bundle / "dataset.leaves").read_bytes())
    raw[64 + 32 * 5] ^= 1  # one sample's hash
    (bundle / "dataset.leaves").write_bytes(bytes(raw))
    for mode in ("interactive", "offline"):  # offline checks a leaves file the bundle carries too
        with pytest.raises(VerificationError, match="leaves do not hash to the committed data root"):
            Verifier(policy=Policy(challenges=1, mode=mode, nonce=b"r")).verify(bundle, Evidence(response=d / "resp"))
    (bundle / "dataset.leaves").write_bytes(b"WLEAVES1" + bytes(10))
    assert main(["verify", "--allow-weak", str(bundle), "--mode", "interactive", "--response", str(d / "resp"), "--nonce", "72"]) == 2


def test_a_dataset_root_that_mislabels_documents_is_caught_where_its_samples_are_replayed(tmp_path, monkeypatch):
    # A trainer commits a dataset root of its own making: every window of one training file is
    # labelled as another file's. Its leaves, batch roots and used trees all agree with that root,
    # so only a sample's own bytes, which name its true file, show the lie: at every replayed step
    # that holds such a window (offline, the verifier's own dataset has another root).
    task = build_task("tinygpt", dict(GPT, steps=8))
    ds = task.dataset()
    leaves = ds.leaves
    victim = leaves.documents(0)[0]
    decoy = next(h for h in ds.document_hashes if h != victim)
    table = np.array(leaves.table)
    table[(table == np.frombuffer(victim, np.uint8)).all(axis=1)] = np.frombuffer(decoy, np.uint8)
    lie = DatasetLeaves("prefix32", leaves.hashes, leaves.first, leaves.count, table)
    monkeypatch.setattr(StdlibWindows, "leaves", property(lambda self: lie))
    monkeypatch.setattr(StdlibWindows, "root", property(lambda self: lie.root()))
    bundle = train_tiny(tmp_path / "b", task="tinygpt", config=dict(GPT, steps=8), checkpoint_every=4)
    respond(bundle, tmp_path / "resp", nonce=b"r", challenges=ALL)
    monkeypatch.undo()
    b = open_bundle(bundle)
    holding = {r.step for r in b.steps if any(victim in leaves.documents(i) for i in r.batch)}
    assert holding, "choose a victim file that the run trains on"
    with pytest.raises(RunRejected) as info:
        _interactive(bundle, tmp_path / "resp")
    failed = [r for r in info.value.verdict.results if not r.passed]
    # after a failed segment, the next ones could not start (witness respond ships only the states an
    # accepted audit reads): each says so, and is no second failure
    assert {r.step for r in failed if not r.failure.startswith("not replayed")} == holding
    assert all("names other documents than the dataset's committed leaves" in f for f in info.value.failures)
    with pytest.raises(MalformedInput, match="committed dataset .* is not the one here"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)
