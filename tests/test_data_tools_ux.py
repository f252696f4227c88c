"""The data tools read as a person expects: ``data check`` says VALID or INVALID in one line before
its JSON, ``data find --limit`` lists used ones first, and a query input that plainly does not fit
the dataset's kind gets a hint naming the flag that fits (beside an answer that stays as it was)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import train_tiny

from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.cli.data import used_first
from witness.data.hints import file_hint, looks_like_text, text_hint
from witness.data.tokens import TokenCorpus, byte_tokens, write_llmc_shard
from witness.task import registry
from witness.task.generic import GenericTask
from witness.verify.data_queries import check_data_proof, run_commitments, search_text


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(map(str, args)))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A finished run of ``tiny`` (every sample its own document), a used sample and a needle."""
    d = tmp_path_factory.mktemp("tiny")
    bundle = train_tiny(d / "run")
    run, _ = run_commitments(bundle)
    used = sorted({i for r in open_bundle(bundle).steps for i in r.batch})
    (d / "used.bin").write_bytes(run.dataset.sample_bytes(used[0]))
    return d, bundle, run


# --- data check: a VALID / INVALID line, the JSON whole after it --------------------------------

def test_check_prints_a_valid_line_then_the_whole_json(tiny, tmp_path, capsys):
    d, bundle, _ = tiny
    key = tmp_path / "k.pem"
    assert _cli(capsys, "data", "exclude", bundle, "--text", "never in tiny", "--out", tmp_path / "exc.json",
                "--key", key)[0] == 0
    assert _cli(capsys, "data", "include", bundle, "--file", d / "used.bin", "--out", tmp_path / "inc.json",
                "--key", key)[0] == 0
    inc = json.loads((tmp_path / "inc.json").read_text())
    for name, pin, kind, claim, against in (
            ("exc.json", ["--bundle", bundle], "exclusion", "was never used by the run", "the bundle"),
            ("inc.json.dsse.json", ["--bundle", bundle], "inclusion",
             f"was used by the run, in {len(inc['uses'])} step(s)", "the bundle"),
            ("exc.json", [], "exclusion", "was never used by the run", "the proof's own signed head")):
        code, out, err = _cli(capsys, "data", "check", tmp_path / name, *pin)
        assert code == 0, err
        first, rest = out.split("\n", 1)
        assert first.startswith(f"VALID: {kind} proof: document ") and claim in first and against in first, first
        summary = json.loads(rest)  # the JSON still comes whole, after the one line
        assert summary["kind"] == kind and summary["document"] in first
    # --json: the JSON object alone, for a script
    code, out, _ = _cli(capsys, "data", "check", tmp_path / "exc.json", "--bundle", bundle, "--json")
    assert code == 0 and json.loads(out)["valid"] is True and json.loads(out)["kind"] == "exclusion"
    # "never in tiny" is no document of the run's dataset: the proof itself carries the caveat, signed, and its
    # check shows it (issue 52, loops item 5); a proof that names another scope is refused
    proof = json.loads((tmp_path / "exc.json").read_text())
    assert proof["scope"] == "bytes" and "not a fragment of a used document" in json.loads(out)["scope"]
    (tmp_path / "other.json").write_text(json.dumps(dict(proof, scope="document")))
    assert _cli(capsys, "data", "check", tmp_path / "other.json", "--bundle", bundle)[0] == 2


def test_check_prints_one_invalid_line_and_keeps_its_exit_codes(tiny, tmp_path, capsys):
    _, bundle, _ = tiny
    assert _cli(capsys, "data", "exclude", bundle, "--text", "never in tiny", "--out", tmp_path / "exc.json",
                "--key", tmp_path / "k.pem")[0] == 0
    proof = json.loads((tmp_path / "exc.json").read_text())
    proof["document"] = "00" * 32  # another document: the absence path no longer brackets it
    (tmp_path / "bad.json").write_text(json.dumps(proof))
    code, out, err = _cli(capsys, "data", "check", tmp_path / "bad.json", "--bundle", bundle)
    assert code == 1 and out == "" and "VALID" not in out
    lines = err.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith(f"INVALID: {tmp_path / 'bad.json'}: "), err
    code, out, _ = _cli(capsys, "data", "check", tmp_path / "bad.json", "--json")
    assert code == 1 and json.loads(out)["valid"] is False and json.loads(out)["failures"]
    (tmp_path / "junk.json").write_text("{not json")
    code, out, err = _cli(capsys, "data", "check", tmp_path / "junk.json")
    assert code == 2 and out == "" and err.startswith("UNUSABLE INPUT: ") and "VALID" not in err


# --- data find: used ones first ---------------------------------------------------------------

def _needle_with_unused_first(run) -> bytes:
    """A byte the dataset holds where, in dataset order, an unused sample comes before every used one."""
    for a in range(256):
        found = search_text(run, bytes([a]), 10_000)
        if found["samples_used"] >= 2 and not found["samples"][0]["used"]:
            return bytes([a])
    raise AssertionError("no such needle")


def test_find_lists_used_ones_first_so_a_limit_hides_no_used_one(tiny, tmp_path, capsys):
    _, bundle, run = tiny
    needle = _needle_with_unused_first(run)
    (tmp_path / "needle").write_bytes(needle)
    whole = search_text(run, needle, 10_000)
    code, out, _ = _cli(capsys, "data", "find", bundle, "--file", tmp_path / "needle", "--limit", "1", "--json")
    found = json.loads(out)
    assert code == 0 and found["samples"][0]["used"] and found["documents"][0]["used"], found
    assert len(found["samples"]) == len(found["documents"]) == 1 and found["samples_found"] == whole["samples_found"]
    # as many as are used, in dataset order, then the unused ones
    n = whole["samples_used"] + 1
    found = json.loads(_cli(capsys, "data", "find", bundle, "--file", tmp_path / "needle", "--limit", n, "--json")[1])
    used = sorted(s["index"] for s in whole["samples"] if s["used"])
    assert [s["index"] for s in found["samples"][:-1]] == used and not found["samples"][-1]["used"]
    # the text listing: USED lines first, and the line for the rest says how many of them were used
    code, out, _ = _cli(capsys, "data", "find", bundle, "--file", tmp_path / "needle", "--limit", "1")
    listed = [line for line in out.split("\n") if line.startswith("  USED") or line.startswith("  unused")]
    assert code == 0 and len(listed) == 1 and listed[0].startswith("  USED"), out
    assert f"… and {whole['documents_found'] - 1} more, {whole['documents_used'] - 1} of them used (--limit)" in out


def test_used_first_keeps_dataset_order_within_each_group():
    found = {"documents": [], "samples": [{"index": i, "used": i in (3, 5)} for i in range(6)]}
    assert [s["index"] for s in used_first(found, 3)["samples"]] == [3, 5, 0]
    assert [s["index"] for s in used_first(found, 10)["samples"]] == [3, 5, 0, 1, 2, 4]
    assert found["samples"][0]["index"] == 0  # the answer it was given is left as it was


# --- a query input that does not fit the dataset's kind -----------------------------------------

EOT = 256  # byte tokens 0..255 in a 16-bit corpus; the end-of-text token is the next id
TEXTS = [f"document {k:02d}: the quick brown fox jumps {'over' if k % 2 else 'past'} the lazy dog.\n"
         for k in range(40)]


class TextCorpusLM(GenericTask):
    """A bigram model on a 16-bit token corpus of byte tokens (a text's UTF-8 bytes as ids)."""

    name = "ux-text-corpus-test"
    document_rule = "prefix32"
    probes = 2
    source = None  # set by the fixture: the shard's folder

    def make_model(self):
        return torch.nn.Sequential(torch.nn.Embedding(EOT + 1, 4), torch.nn.Linear(4, EOT + 1))

    def make_dataset(self):
        return TokenCorpus(self.source, 8, eot=EOT, tokenize=byte_tokens)

    def collate(self, samples):
        t = torch.from_numpy(np.stack([np.frombuffer(s[40:], "<u2") for s in samples]).astype(np.int64))
        return {"x": t[:, :-1], "y": t[:, 1:]}

    def example_losses(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs.transpose(1, 2), batch["y"], reduction="none").mean(dim=1)


class TensorLM(GenericTask):
    """A linear classifier on samples of tensors (each its safetensors bytes, its own document)."""

    name = "ux-tensor-test"
    probes = 2

    def make_model(self):
        return torch.nn.Linear(4, 2)

    def make_dataset(self):
        g = torch.Generator().manual_seed(3)
        return [{"x": torch.randn(4, generator=g), "y": torch.tensor(i % 2)} for i in range(64)]


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    stream = []
    for text in TEXTS:
        stream += list(text.encode()) + [EOT]
    write_llmc_shard(d / "s0.bin", np.array(stream, "<u2"))
    mp = pytest.MonkeyPatch()
    mp.setattr(TextCorpusLM, "source", d)
    for task in (TextCorpusLM, TensorLM):
        mp.setitem(registry.BUILTIN, task.name, task)  # as a plugin would register it
    registry._built.cache_clear()
    yield d
    mp.undo()
    registry._built.cache_clear()


@pytest.fixture(scope="module")
def token_run(registered, tmp_path_factory):
    """A run on the corpus, and a document it used: its text and its token file."""
    d = tmp_path_factory.mktemp("token-run")
    bundle = train_tiny(d / "run", task=TextCorpusLM.name, config={"steps": 4, "batch_size": 4}, checkpoint_every=2)
    run, _ = run_commitments(bundle)
    tokens = next(content for _, h, content in run.dataset.documents_list() if h in run.usage.documents)
    text = bytes(np.frombuffer(tokens, "<u2").astype(np.uint8)).decode()
    assert len(text) % 2 == 0  # read as 2-byte ids, the text file is a whole number of them
    (d / "doc.txt").write_text(text)
    (d / "doc.bin").write_bytes(tokens)
    return d, bundle, text


def test_a_text_file_on_a_token_corpus_gets_a_hint_naming_text(token_run, tmp_path, capsys):
    d, bundle, text = token_run
    key = tmp_path / "k.pem"
    # the answer for the bytes as token ids stands ("never used"), and the hint names --text
    code, out, err = _cli(capsys, "data", "include", bundle, "--file", d / "doc.txt", "--out", tmp_path / "a.json",
                          "--key", key)
    assert code == 1 and "never used" in err and "hint:" in err and "--text" in err, err
    assert not (tmp_path / "a.json").exists()
    # ... and --text gives the real answer: the run used this text
    code, out, err = _cli(capsys, "data", "include", bundle, "--text", text, "--out", tmp_path / "b.json", "--key", key)
    assert code == 0 and "was used" in out and "hint:" not in err
    # the token file fits: used, no hint
    code, out, err = _cli(capsys, "data", "include", bundle, "--file", d / "doc.bin", "--out", tmp_path / "c.json",
                          "--key", key)
    assert code == 0 and "hint:" not in err
    # an exclusion proof for the ids is true, and is written; the hint goes beside it
    code, out, err = _cli(capsys, "data", "exclude", bundle, "--file", d / "doc.txt", "--out", tmp_path / "d.json",
                          "--key", key)
    assert code == 0 and "never used" in out and "hint:" in err and "--text" in err and (tmp_path / "d.json").exists()
    code, out, err = _cli(capsys, "data", "exclude", bundle, "--file", d / "doc.bin", "--out", tmp_path / "e.json",
                          "--key", key)
    assert code == 1 and "WAS used" in err and "hint:" not in err
    # find: nothing found for the text read as ids, and the hint; the text itself is found
    (tmp_path / "frag.txt").write_text(text[:12])
    code, out, err = _cli(capsys, "data", "find", bundle, "--file", tmp_path / "frag.txt")
    assert code == 1 and "0 document(s)" in out and "hint:" in err and "--text" in err, err
    code, out, err = _cli(capsys, "data", "find", bundle, "--text", text[:12])
    assert code == 0 and "hint:" not in err
    # an odd-length text file is no whole number of 2-byte ids: an error, with the same hint
    (tmp_path / "odd.txt").write_text(text + "x")
    code, out, err = _cli(capsys, "data", "include", bundle, "--file", tmp_path / "odd.txt", "--out",
                          tmp_path / "f.json", "--key", key)
    assert code == 2 and "whole number of 2-byte tokens" in err and "hint:" in err and "--text" in err, err


def test_text_on_a_dataset_of_tensors_gets_a_hint_naming_file(registered, tmp_path, capsys):
    bundle = train_tiny(tmp_path / "run", task=TensorLM.name, config={"steps": 4, "batch_size": 4}, checkpoint_every=2)
    run, _ = run_commitments(bundle)
    used = open_bundle(bundle).steps[0].batch[0]
    (tmp_path / "sample.bin").write_bytes(run.dataset.sample_bytes(used))
    key = tmp_path / "k.pem"
    code, _, err = _cli(capsys, "data", "include", bundle, "--text", "a cat", "--out", tmp_path / "a.json", "--key", key)
    assert code == 1 and "never used" in err and "hint:" in err and "--file" in err, err
    code, out, err = _cli(capsys, "data", "exclude", bundle, "--text", "a cat", "--out", tmp_path / "b.json", "--key", key)
    assert code == 0 and "never used" in out and "hint:" in err and "--file" in err
    code, _, err = _cli(capsys, "data", "include", bundle, "--file", tmp_path / "sample.bin", "--out",
                        tmp_path / "c.json", "--key", key)
    assert code == 0 and "hint:" not in err
    assert check_data_proof(json.loads((tmp_path / "c.json").read_text()))["kind"] == "inclusion"


def test_the_hint_is_given_only_where_the_input_plainly_does_not_fit(token_run, tiny):
    d, bundle, text = token_run
    corpus, _ = run_commitments(bundle)
    tiny_run = tiny[2]
    ids = np.frombuffer(text.encode(), np.uint8).astype("<u2").tobytes()  # the text's own ids: NUL high bytes
    assert looks_like_text(text.encode()) and not looks_like_text(ids)
    assert not looks_like_text(b"\xff\xfe" + text.encode()) and not looks_like_text(b"")
    assert not looks_like_text(np.array([70000, 3], "<u4").tobytes())  # 4-byte ids: a NUL in every one below 2**24
    assert file_hint(corpus.dataset, "doc.txt", text.encode()) is not None
    assert file_hint(corpus.dataset, "doc.bin", ids) is None
    assert file_hint(tiny_run.dataset, "doc.txt", text.encode()) is None  # bytes are what a byte dataset holds
    assert text_hint(corpus.dataset) is None and text_hint(tiny_run.dataset) is None  # neither holds tensors
