"""Exact data inclusion and exclusion proofs: the CLI, tampering, and the binding to replay."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil

import pytest
from helpers import train_tiny

from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.signing import generate_key
from witness.data.dataset import sample_hash
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.record import Commitments, Recorder
from witness.task import build_task
from witness.verify import Policy, Verifier
from witness.verify.data_queries import check_data_proof as check_proof

SMALL = {"steps": 12, "n_layer": 1, "d_model": 32, "n_head": 2, "batch_size": 8,
         "corpus_max_bytes": 300_000, "warmup": 2}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "run"
    task = build_task("tinygpt", SMALL)
    Recorder.create(task, out, generate_key(), r=b"\x05" * 32,
                    commit=Commitments(checkpoint_every=6)).train(progress=False)
    ds = task.dataset()
    used_docs = set()
    for line in (out / "log.jsonl").read_bytes().split(b"\n")[1:-2]:
        for i in parse_canonical_json(line)["batch"]:
            used_docs.add(ds.windows[i][0])
    used = sorted(used_docs)[0]
    unused = next(d for d in range(len(ds.documents)) if d not in used_docs)
    from witness.data.stdlib import stdlib_root

    root = stdlib_root()
    return out, root / ds.documents[used][0], root / ds.documents[unused][0], task


def _run(*args) -> int:
    return main(list(map(str, args)))


def test_include_exclude_and_check(gpt, tmp_path, capsys):
    out, used, unused, task = gpt
    key = tmp_path / "k.pem"
    assert _run("data", "include", out, "--file", used, "--out", tmp_path / "inc.json", "--key", key) == 0
    assert _run("data", "exclude", out, "--file", unused, "--out", tmp_path / "exc.json", "--key", key) == 0
    assert "scope" not in json.loads((tmp_path / "exc.json").read_text())  # a document of the dataset: no caveat
    assert _run("data", "include", out, "--file", unused, "--out", tmp_path / "x.json", "--key", key) == 1
    assert "never used" in capsys.readouterr().err
    assert _run("data", "exclude", out, "--file", used, "--out", tmp_path / "x.json", "--key", key) == 1
    assert "WAS used" in capsys.readouterr().err
    for proof in ("inc.json", "exc.json", "inc.json.dsse.json", "exc.json.dsse.json"):
        assert _run("data", "check", tmp_path / proof, "--bundle", out) == 0, proof
        assert _run("data", "check", tmp_path / proof) == 0
    inc = json.loads((tmp_path / "inc.json").read_text())
    # Every step that used the document is listed, and no other.
    ds = task.dataset()
    doc = ds.document_hash(used.read_bytes())
    want = [t for t, line in enumerate((out / "log.jsonl").read_bytes().split(b"\n")[1:-2])
            if any(ds.document_of(ds.sample_bytes(i)) == doc for i in parse_canonical_json(line)["batch"])]
    assert [u["step"] for u in inc["uses"]] == want and want
    assert (tmp_path / "exc.json").stat().st_size < 2048
    env = json.loads((tmp_path / "exc.json.dsse.json").read_text())
    stmt = json.loads(base64.b64decode(env["payload"]))
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    # the subject is the released model file, by the SHA-256 of its bytes (what sigstore tooling matches);
    # the state hash stays in the predicate, inside the signed tree head
    model = tmp_path / "model.safetensors"
    assert stmt["subject"] == [{"name": "model.safetensors",
                                "digest": {"sha256": hashlib.sha256(model.read_bytes()).hexdigest()}}]
    final = parse_canonical_json((out / "log.jsonl").read_bytes().split(b"\n")[-2])
    assert stmt["predicate"]["tree_head"]["extensions"]["final_state_hash"] == final["final_state_hash"]
    assert _run("identify", out, "--weights", model) == 0
    assert _run("data", "check", tmp_path / "exc.json.dsse.json", "--model", model) == 0


def test_a_statement_names_only_the_released_model(gpt, tmp_path, capsys):
    out, _, unused, _ = gpt
    assert _run("data", "exclude", out, "--file", unused, "--out", tmp_path / "exc.json", "--key", tmp_path / "k") == 0
    model = tmp_path / "model.safetensors"
    env = tmp_path / "exc.json.dsse.json"
    # another file is not the subject, even one holding the same tensors (its bytes differ)
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other.safetensors"
    save_file(load_file(str(model)), str(other), metadata={"note": "re-saved"})
    assert _run("identify", out, "--weights", other) == 0  # the same model ...
    assert _run("data", "check", env, "--model", other) == 1  # ... but not the file the statement names
    assert "not about other.safetensors" in capsys.readouterr().err
    # bare JSON names no file
    assert _run("data", "check", tmp_path / "exc.json", "--model", model) == 2
    # a proof may not name a model file that is not the run's final model
    tensors = load_file(str(model))
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1
    save_file(tensors, str(tmp_path / "wrong.safetensors"))
    assert _run("data", "exclude", out, "--file", unused, "--out", tmp_path / "x.json", "--key", tmp_path / "k",
                "--model", tmp_path / "wrong.safetensors") == 2
    assert "does not hold the run's final model" in capsys.readouterr().err


def _proof(gpt, tmp_path, kind):
    out, used, unused, _ = gpt
    path = tmp_path / f"{kind}.json"
    assert _run("data", "include" if kind == "inc" else "exclude", out, "--file",
                used if kind == "inc" else unused, "--out", path, "--key", tmp_path / "k.pem") == 0
    return json.loads(path.read_text())


def _flip_b64(value: str, byte: int = 0) -> str:
    raw = bytearray(base64.b64decode(value))
    raw[byte] ^= 1
    return base64.b64encode(bytes(raw)).decode()


def test_tampered_exclusion_proofs_are_invalid(gpt, tmp_path):
    good = _proof(gpt, tmp_path, "exc")
    check_proof(good)
    a = good["absence"]
    flip = "0" + a["upper"][1:] if a["upper"][0] != "0" else "1" + a["upper"][1:]
    bad = {
        "changed sibling": {**good, "absence": {**a, "path": _flip_b64(a["path"], 5)}},
        "changed index": {**good, "absence": {**a, "index": a["index"] + 1}},
        "changed neighbour": {**good, "absence": {**a, "upper": flip}},
        "other document": {**good, "document": gpt[3].dataset().document_hash(gpt[1].read_bytes()).hex()},
        "forged head": {**good, "tree_head": {**good["tree_head"], "size": good["tree_head"]["size"] + 1}},
    }
    for name, proof in bad.items():
        with pytest.raises(VerificationError):
            check_proof(proof)
        assert name


def test_non_adjacent_pair_is_invalid(gpt, tmp_path):
    from witness.commit.merkle import MerkleTree
    from witness.commit.sorted_tree import pair_leaf
    from witness.data.proofs import pack
    from witness.verify.data_queries import run_commitments

    good = _proof(gpt, tmp_path, "exc")
    run, _ = run_commitments(gpt[0])
    tree = run.usage.documents
    i = 3
    hidden = tree.values[i]  # a used document, hidden by pairing its two neighbours
    leaves = list(tree.tree.levels[0])
    leaves[i] = pair_leaf(tree.values[i - 1], tree.values[i + 1])
    path = MerkleTree(leaves).inclusion_proof(i)
    forged = {**good, "document": hidden.hex(),
              "absence": {"index": i, "lower": tree.values[i - 1].hex(), "upper": tree.values[i + 1].hex(),
                          "path": pack(path)}}
    with pytest.raises(VerificationError):
        check_proof(forged)


def test_tampered_inclusion_proofs_are_invalid(gpt, tmp_path):
    good = _proof(gpt, tmp_path, "inc")
    check_proof(good)
    use = good["uses"][0]
    rec = dict(use["record"], loss=use["record"]["loss"] + 1)
    bad = {
        "changed member path": {**good, "member": {**good["member"], "path": _flip_b64(good["member"]["path"])}},
        "changed member index": {**good, "member": {**good["member"], "index": good["member"]["index"] + 1}},
        "edited record": {**good, "uses": [{**use, "record": rec}] + good["uses"][1:]},
        "wrong position": {**good, "uses": [{**use, "position": (use["position"] + 1) % 8}] + good["uses"][1:]},
        "other sample": {**good, "uses": [{**use, "sample": "00" * 60}] + good["uses"][1:]},
        "changed log path": {**good, "uses": [{**use, "log_proof": _flip_b64(use["log_proof"])}] + good["uses"][1:]},
    }
    for name, proof in bad.items():
        with pytest.raises(VerificationError):
            check_proof(proof)
        assert name


def test_proof_against_the_wrong_root_and_unusable_input(gpt, tmp_path, capsys):
    good = _proof(gpt, tmp_path, "exc")
    other = train_tiny(tmp_path / "other")
    (tmp_path / "p.json").write_text(json.dumps(good))
    assert _run("data", "check", tmp_path / "p.json", "--bundle", other) == 1
    assert "pinned" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{not json")
    assert _run("data", "check", tmp_path / "junk.json") == 2
    (tmp_path / "wrong.json").write_text(json.dumps({"format": "something-else"}))
    assert _run("data", "check", tmp_path / "wrong.json") == 2
    with pytest.raises(MalformedInput):
        check_proof({**good, "absence": {**good["absence"], "path": "!!notbase64"}})


def test_tampered_dsse_envelope_is_invalid(gpt, tmp_path, capsys):
    _proof(gpt, tmp_path, "exc")
    env = json.loads((tmp_path / "exc.json.dsse.json").read_text())
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["document"] = "00" * 32
    env["payload"] = base64.b64encode(canonical_json(stmt)).decode()
    (tmp_path / "bad.dsse.json").write_text(json.dumps(env))
    assert _run("data", "check", tmp_path / "bad.dsse.json") == 1
    assert "DSSE" in capsys.readouterr().err


def test_binding_exclusion_proof_exists_but_replay_rejects(tmp_path):
    """A run trains on a sample it never committed: the commitments say 'never used', replay says no."""
    hidden = bytes([7, 250, 3, 9, 100, 1, 2, 3, 1])  # 8 features + label, not in the dataset

    def cheat(rec, t, batch):
        if t == 10:
            ds = rec.task.dataset()
            samples = [ds.sample_bytes(i) for i in rec.batch_indices(t)]
            samples[0] = hidden
            return rec.task.train_step(rec.model, rec.optimizer, rec.task.collate(samples), rec.lr(t), rec.step_seed(t))
        return None

    run = train_tiny(tmp_path / "run", cheat=cheat)
    task = build_task("tiny", {"steps": 40})
    assert sample_hash(hidden) not in set(task.dataset().hashes)
    (tmp_path / "hidden.bin").write_bytes(hidden)
    # Half 1: the commitments alone happily prove the hidden sample was never used.
    assert _run("data", "exclude", run, "--file", tmp_path / "hidden.bin", "--out", tmp_path / "exc.json",
                "--key", tmp_path / "k.pem") == 0
    assert _run("data", "check", tmp_path / "exc.json", "--bundle", run) == 0
    # Half 2: the run is rejected as soon as a challenge replays step 10.
    from witness.bundle.reader import open_bundle
    from witness.verify.challenges import draw_challenges

    head = open_bundle(run).final_head
    elsewhere = next(n.to_bytes(2, "big") for n in range(1000)
                     if not 10 <= draw_challenges(head, n.to_bytes(2, "big"), 40, 1)[0].step < 20)
    Verifier(policy=Policy(challenges=1, nonce=elsewhere)).verify(run)  # a challenge outside [10, 20) does not see it
    with pytest.raises(RunRejected, match="step 10: replay"):
        Verifier(policy=Policy(challenges=40)).verify(run)


def test_verifier_rejects_a_false_used_data_commitment(tmp_path):
    run = train_tiny(tmp_path / "run")
    shutil.copytree(run, tmp_path / "copy")
    from helpers import log_lines as _lines
    from helpers import resign as _resign

    key = generate_key()
    lines = _lines(tmp_path / "copy")
    end = parse_canonical_json(lines[-1])
    end["used_documents"]["size"] -= 1
    manifest = parse_canonical_json(lines[0])
    from witness.commit.signing import public_hex

    manifest["public_key"] = public_hex(key.public_key())
    _resign(tmp_path / "copy", key, [canonical_json(manifest)] + lines[1:-1] + [canonical_json(end)])
    with pytest.raises(VerificationError, match="used-document tree is not the one the logged batches give"):
        Verifier(policy=Policy(challenges=1)).verify(tmp_path / "copy")


def test_check_against_a_published_tree_head_file(gpt, tmp_path):
    out = gpt[0]
    _proof(gpt, tmp_path, "exc")
    b = open_bundle(out)
    pinned = tmp_path / "head.json"
    pinned.write_text(json.dumps({"tree_head": b.final_head.to_json(), "public_key": b.manifest.public_key}))
    assert _run("data", "check", tmp_path / "exc.json", "--tree-head", pinned) == 0
    other = open_bundle(train_tiny(tmp_path / "other"))
    pinned.write_text(json.dumps({"tree_head": other.final_head.to_json()}))
    assert _run("data", "check", tmp_path / "exc.json", "--tree-head", pinned) == 1
    pinned.write_text("{not json")
    assert _run("data", "check", tmp_path / "exc.json", "--tree-head", pinned) == 2


def test_search_answers_was_this_text_used_and_exclusion_says_what_it_covers(gpt, tmp_path, capsys):
    out, used, unused, task = gpt
    ds = task.dataset()
    used_batch = parse_canonical_json((out / "log.jsonl").read_bytes().split(b"\n")[1])["batch"]
    fragment = ds.sample_bytes(used_batch[0])[40:72]  # 32 bytes from inside a window step 0 trained on
    assert _run("data", "search", out, "--file", _bytes_file(tmp_path / "f", fragment), "--json") == 0
    found = json.loads(capsys.readouterr().out)
    assert found["samples_used"] >= 1 and any(s["index"] == used_batch[0] and s["used"] for s in found["samples"])
    assert found["documents_used"] >= 1
    # a text nothing holds: exit 1, nothing found
    assert _run("data", "search", out, "--text", "no such text anywhere \x00\x01 in the corpus") == 1
    assert "0 document(s)" in capsys.readouterr().out
    # an exclusion proof for a fragment is valid, but says that it covers only a whole document of those bytes
    assert _run("data", "exclude", out, "--file", _bytes_file(tmp_path / "g", fragment), "--out", tmp_path / "e.json",
                "--key", tmp_path / "k.pem") == 0
    assert "no document of the run's dataset has exactly these bytes" in capsys.readouterr().err
    # a whole document of the dataset that was not used: no such note
    assert _run("data", "exclude", out, "--file", unused, "--out", tmp_path / "u.json", "--key", tmp_path / "k.pem") == 0
    assert "no document of the run's dataset" not in capsys.readouterr().err


def _bytes_file(path, data: bytes):
    path.write_bytes(data)
    return path
