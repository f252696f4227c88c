"""Token corpora as pretraining publishes them: llm.c / modded-nanogpt shards, nanoGPT's .bin, a
directory of shards as one dataset, documents at the end-of-text token, committed in a stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import train_tiny

from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.commit.hashing import tagged_hash
from witness.data import tokens as T
from witness.data.dataset import Dataset, sample_hash
from witness.data.leaves import documents_key, read_leaves
from witness.data.proofs import pack, unpack
from witness.data.tokens import (
    DOCUMENT_TAGS,
    TokenCorpus,
    open_shard,
    shard_format,
    write_llmc_shard,
)
from witness.errors import MalformedInput, VerificationError
from witness.task import registry
from witness.task.generic import GenericTask
from witness.verify import Evidence, Policy, Verifier
from witness.verify.data_queries import check_data_proof, run_commitments
from witness.verify.respond import respond

EOT = 7


def _reference(stream: np.ndarray, block: int, width: int) -> tuple[list[bytes], list[list[bytes]], list[bytes]]:
    """Every window's canonical bytes and documents, and every document's hash, the slow obvious way."""
    docs, i = [], 0
    while i < len(stream):
        if stream[i] == EOT:
            i += 1
            continue
        j = i
        while j < len(stream) and stream[j] != EOT:
            j += 1
        docs.append((i, j))
        i = j
    hashes = [tagged_hash(DOCUMENT_TAGS[width], stream[a:b].tobytes()) for a, b in docs]
    canonical, touched = [], []
    for w in range((len(stream) - 1) // block):
        s0 = w * block
        mine = [hashes[k] for k, (a, b) in enumerate(docs) if a < s0 + block + 1 and b > s0]
        canonical.append(documents_key(mine) + s0.to_bytes(8, "big") + stream[s0:s0 + block + 1].tobytes())
        touched.append(mine)
    return canonical, touched, hashes


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_a_directory_of_shards_commits_as_one_stream_exactly(tmp_path, monkeypatch, width, seed):
    rng = np.random.default_rng(seed)
    dtype = "<u2" if width == 2 else "<u4"
    stream = rng.integers(0, 12, size=int(rng.integers(50, 3000))).astype(dtype)
    if seed == 3:  # a document far longer than a batch, and runs of end-of-text tokens
        stream[:2000] = np.where(stream[:2000] == EOT, 1, stream[:2000])
        stream[2500:2520] = EOT
    parts = np.split(stream, sorted(rng.choice(np.arange(1, len(stream)), size=3, replace=False)))
    for k, part in enumerate(parts):  # llm.c shards and nanoGPT's headerless files, mixed
        if width == 2 and k % 2:
            part.tofile(tmp_path / f"s{k:02d}.bin")
        else:
            write_llmc_shard(tmp_path / f"s{k:02d}.bin", part)
    block = int(rng.integers(1, 40))
    monkeypatch.setattr(T, "STREAM_BYTES", int(rng.integers(8, 200)))  # tiny batches: every boundary case
    corpus = TokenCorpus(tmp_path, block, eot=EOT)
    canonical, touched, _ = _reference(stream, block, width)
    assert len(corpus) == len(canonical) and corpus.width == width
    assert [corpus.sample_bytes(i) for i in range(len(corpus))] == canonical
    assert [corpus.leaves.documents(i) for i in range(len(corpus))] == touched
    assert [bytes(h) for h in corpus.leaves.hashes] == [sample_hash(c) for c in canonical]

    class Reference(Dataset):  # the generic, per-sample path to the same commitment
        DOCUMENT_RULE = "prefix32"

        def __len__(self):
            return len(canonical)

        def sample_bytes(self, i):
            return canonical[i]

        def sample_documents(self, i, c):
            return touched[i]

    assert corpus.root == Reference().root
    out = tmp_path.parent / f"{tmp_path.name}.leaves"
    assert corpus.commit(out) == corpus.root
    leaves, named = read_leaves(out, samples=len(corpus), rule="prefix32")
    assert named == corpus.root and leaves.root() == corpus.root
    reread = TokenCorpus(tmp_path, block, eot=EOT, leaves_path=out)
    assert reread.root == corpus.root and reread.sample_bytes(len(corpus) - 1) == canonical[-1]


def test_the_shard_formats(tmp_path):
    tokens = np.arange(1000, dtype="<u2")
    write_llmc_shard(tmp_path / "a.bin", tokens)
    header = np.fromfile(tmp_path / "a.bin", "<i4", 256)
    assert (header[0], header[1], header[2]) == (20240520, 1, 1000) and (header[3:] == 0).all()
    assert (open_shard(tmp_path / "a.bin") == tokens).all() and open_shard(tmp_path / "a.bin").dtype == "<u2"
    write_llmc_shard(tmp_path / "b.bin", tokens.astype("<u4") + 70_000)
    assert np.fromfile(tmp_path / "b.bin", "<i4", 1)[0] == 20240801
    assert (open_shard(tmp_path / "b.bin") == tokens.astype("<u4") + 70_000).all()
    tokens.tofile(tmp_path / "raw.bin")  # nanoGPT's headerless uint16
    assert (open_shard(tmp_path / "raw.bin") == tokens).all()
    with pytest.raises(ValueError, match="not an llm.c token shard"):
        open_shard(tmp_path / "raw.bin", "llmc")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="whole number"):
        open_shard(tmp_path / "odd.bin", "u16")
    # a damaged header is an error, never 512 tokens of raw data: a count that does not fit the
    # file, a wrong version, a wrong magic under an llm.c-shaped header, an all-zero header
    damaged = {"lie": ([20240520, 1, 5], "it counts 5 tokens and the file holds 10"),
               "version": ([20240520, 3, 10], "its version is 3; magic 20240520 goes with version 1"),
               "magic": ([20240521, 1, 10], "its magic is 20240521, not llm.c's"),
               "zero": ([0, 0, 0], "its magic is 0, not llm.c's")}
    for name, (ints, says) in damaged.items():
        (tmp_path / f"{name}.bin").write_bytes(np.array(ints, "<i4").tobytes() + bytes(4 * 253 + 20))
        with pytest.raises(ValueError, match=f"has an llm.c shard header, but {says}"):
            open_shard(tmp_path / f"{name}.bin")
        assert len(open_shard(tmp_path / f"{name}.bin", "u16")) == (4 * 256 + 20) // 2  # asked for: raw
        (tmp_path / f"{name}.bin").unlink()
    assert shard_format(open_shard(tmp_path / "a.bin")) == "llmc-u16"
    assert shard_format(open_shard(tmp_path / "raw.bin")) == "u16"
    (tmp_path / "odd.bin").unlink()
    with pytest.raises(ValueError, match="mix 16- and 32-bit"):
        TokenCorpus(tmp_path, 4)
    with pytest.raises(ValueError, match="too few"):
        TokenCorpus(tmp_path / "a.bin", 5000)


def test_a_window_of_end_of_text_tokens_names_no_document(tmp_path):
    np.array([1, 2, EOT, EOT, EOT, EOT, EOT, 3], "<u2").tofile(tmp_path / "s.bin")
    corpus = TokenCorpus(tmp_path, 2, eot=EOT)  # windows [0:3] [2:5] [4:7]
    assert [len(corpus.leaves.documents(i)) for i in range(len(corpus))] == [1, 0, 0]
    assert corpus.sample_bytes(1)[:32] == documents_key([])


def test_the_leaves_file_is_read_strictly(tmp_path):
    np.arange(200, dtype="<u2").tofile(tmp_path / "s.bin")
    corpus = TokenCorpus(tmp_path / "s.bin", 8, eot=50)
    path = tmp_path / "c.leaves"
    corpus.commit(path)
    good = path.read_bytes()
    read_leaves(path, samples=len(corpus), rule="prefix32")
    with pytest.raises(VerificationError, match="rule 'prefix32'; the run's task decides 'self'"):
        read_leaves(path, samples=len(corpus), rule="self")
    with pytest.raises(MalformedInput, match="holds 24 samples"):
        read_leaves(path, samples=25, rule="prefix32")
    for bad, why in ((good[:-1], "bytes"), (b"XLEAVES1" + good[8:], "not a witness dataset leaves"),
                     (good[:24] + b"\x09" + good[25:], "unknown document rule")):
        path.write_bytes(bad)
        with pytest.raises(MalformedInput, match=why):
            read_leaves(path, samples=len(corpus), rule="prefix32")
    # a sample whose documents lie outside the table
    n = len(corpus)
    first_at = 64 + 32 * n
    path.write_bytes(good[:first_at] + (10**6).to_bytes(8, "little") + good[first_at + 8:])
    with pytest.raises(MalformedInput, match="outside the document table"):
        read_leaves(path, samples=n, rule="prefix32")
    # a flipped bit in a hash reads, and then fails the root
    path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    leaves, _ = read_leaves(path, samples=n, rule="prefix32")
    with pytest.raises(VerificationError, match="do not hash to the committed data root"):
        leaves.check_root(corpus.root)


def test_witness_data_commit(tmp_path, capsys):
    rng = np.random.default_rng(5)
    for k in range(3):
        write_llmc_shard(tmp_path / f"fineweb_train_{k:06d}.bin", rng.integers(0, 50257, 5000).astype("<u2"))
    out = tmp_path / "corpus.leaves"
    assert main(["data", "commit", str(tmp_path), "--block", "64", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    corpus = TokenCorpus(tmp_path, 64)
    assert report["root"] == corpus.root.hex() and report["samples"] == len(corpus) == (15_000 - 1) // 64
    assert report["shards"] == 3 and report["leaves_bytes"] == out.stat().st_size
    assert main(["data", "commit", str(tmp_path), "--block", "64", "--out", str(out)]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err
    assert report["format"] == ["llmc-u16"]  # it says which format it read


def test_witness_data_commit_never_harms_its_data_and_refuses_bad_shards(tmp_path, capsys):
    rng = np.random.default_rng(6)
    shard = tmp_path / "tok.bin"
    write_llmc_shard(shard, rng.integers(0, 50257, 5000).astype("<u2"))
    before = shard.read_bytes()
    for out in (shard, tmp_path / "." / "tok.bin"):  # the source itself, however it is spelled
        assert main(["data", "commit", str(shard), "--block", "64", "--out", str(out), "--force"]) == 2
        assert "is one of the shards being committed" in capsys.readouterr().err
    assert shard.read_bytes() == before
    assert main(["data", "commit", str(tmp_path), "--block", "64", "--out", str(shard), "--force"]) == 2
    assert shard.read_bytes() == before  # a folder's shard too
    # nor through the scratch file beside --out: a shard named OUT.table, or a link there
    table = tmp_path / "t" / "corpus.table"
    table.parent.mkdir()
    write_llmc_shard(table, rng.integers(0, 50257, 5000).astype("<u2"))
    kept = table.read_bytes()
    assert main(["data", "commit", str(table), "--block", "64", "--out", str(tmp_path / "t" / "corpus")]) == 0
    assert table.read_bytes() == kept
    capsys.readouterr()
    capsys.readouterr()
    assert main(["data", "commit", str(shard), "--block", "64", "--out", str(tmp_path / "l"), "--eot", "-1"]) == 2
    assert "end-of-text token -1 is not a 16-bit token id" in capsys.readouterr().err
    bad = tmp_path / "bad" / "tok.bin"
    bad.parent.mkdir()
    bad.write_bytes(np.array([20240520, 1, 4999], "<i4").tobytes() + before[12:])  # one token short of the file
    assert main(["data", "commit", str(bad), "--block", "64", "--out", str(tmp_path / "l2")]) == 2
    err = capsys.readouterr().err
    assert "has an llm.c shard header, but it counts 4999 tokens and the file holds 5000" in err
    assert not (tmp_path / "l2").exists()
    raw = tmp_path / "raw" / "tok.bin"
    raw.parent.mkdir()
    rng.integers(1, 50257, 5000).astype("<u2").tofile(raw)
    assert main(["data", "commit", str(raw), "--block", "64", "--out", str(tmp_path / "l3")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == ["u16"]


def test_the_commitment_benchmark_runs_end_to_end(tmp_path):
    # its smoke test: a corpus of 2,000 windows, every phase, the figures it reports
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parent.parent / "bench" / "data_commit.py"
    r = subprocess.run([sys.executable, str(bench), "--samples", "2000", "--block", "16", "--proofs", "2",
                        "--dir", str(tmp_path), "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["samples"] == out["commit"]["samples"] == 2000 and out["commit"]["native"]
    assert out["commit_vs_plain_sha256"] > 0 and out["proof"]["exclusion_proof_bytes_max"] < 2048
    assert out["read"]["used_samples"] == 200
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # the corpus is gone


# --- a run on a token corpus, end to end -------------------------------------------------------

class CorpusLM(GenericTask):
    """A bigram model on a token corpus of packed windows (a task a plugin would register)."""

    name = "corpus-lm-test"
    document_rule = "prefix32"
    probes = 2
    source = None  # set by the test: the shards' folder

    def make_model(self):
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    def make_dataset(self):
        return TokenCorpus(self.source, 8, eot=EOT)

    def collate(self, samples):
        tokens = np.stack([np.frombuffer(s[40:], "<u2") for s in samples]).astype(np.int64)
        t = torch.from_numpy(tokens)
        return {"x": t[:, :-1], "y": t[:, 1:]}

    def example_losses(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs.transpose(1, 2), batch["y"], reduction="none").mean(dim=1)


@pytest.fixture
def corpus_task(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    for k in range(2):  # short documents: most windows span two or three of them
        shard = rng.integers(0, 7, 600).astype("<u2")
        shard[rng.choice(600, 60, replace=False)] = EOT
        write_llmc_shard(tmp_path / f"s{k}.bin", shard)
    monkeypatch.setattr(CorpusLM, "source", tmp_path)
    monkeypatch.setitem(registry.BUILTIN, CorpusLM.name, CorpusLM)  # as a plugin would register it
    registry._built.cache_clear()
    yield
    registry._built.cache_clear()


def test_a_run_on_a_token_corpus_verifies_and_answers_data_queries(corpus_task, tmp_path, capsys):
    bundle = train_tiny(tmp_path / "run", task=CorpusLM.name, config={"steps": 6, "batch_size": 4}, checkpoint_every=3)
    v = Verifier(policy=Policy(challenges=100)).verify(bundle)
    assert v.accepted and v.replayed_steps == 6
    respond(bundle, tmp_path / "resp", nonce=b"r", challenges=100)
    assert Verifier(policy=Policy(challenges=100, nonce=b"r", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp")).accepted
    run, _ = run_commitments(bundle)
    leaves = run.dataset.leaves
    used = {i for r in open_bundle(bundle).steps for i in r.batch}
    spanning = next(i for i in sorted(used) if len(leaves.documents(i)) > 1)
    doc = leaves.documents(spanning)[-1]  # a document this window only touches at its end
    tokens = next(t for _, _, t in run.dataset._documents(0, run.dataset.tokens_total)
                  if run.dataset.document_hash(t.tobytes()) == doc)
    (tmp_path / "doc.bin").write_bytes(tokens.tobytes())
    assert main(["data", "include", str(bundle), "--file", str(tmp_path / "doc.bin"), "--out", str(tmp_path / "inc.json"),
                 "--key", str(tmp_path / "k.pem")]) == 0
    proof = json.loads((tmp_path / "inc.json").read_text())
    assert proof["version"] == 2 and all(use["documents"] for use in proof["uses"])
    summary = check_data_proof(proof)
    assert summary["task"] == CorpusLM.name and summary["document_rule"] == "prefix32"
    # the document is in the window's list, not its key: a proof that drops it from the list fails
    forged = json.loads(json.dumps(proof))
    for use in forged["uses"]:
        use["documents"] = pack([d for d in unpack(use["documents"], "d") if d != doc] or [doc[::-1]])
    with pytest.raises(VerificationError, match="belongs to another document"):
        check_data_proof(forged)
    never = np.array([1, 2, 3, 4, 5, 6, 1], "<u2").tobytes()
    (tmp_path / "never.bin").write_bytes(never)
    assert main(["data", "exclude", str(bundle), "--file", str(tmp_path / "never.bin"), "--out",
                 str(tmp_path / "exc.json"), "--key", str(tmp_path / "k.pem")]) == 0
    assert check_data_proof(json.loads((tmp_path / "exc.json").read_text()))["kind"] == "exclusion"
    capsys.readouterr()
    # a proof never replaces what it is about: the document, or a file of the bundle
    for out in (tmp_path / "never.bin", bundle / "log.jsonl"):
        assert main(["data", "exclude", str(bundle), "--file", str(tmp_path / "never.bin"), "--out", str(out),
                     "--key", str(tmp_path / "k.pem")]) == 2
        assert "--out" in capsys.readouterr().err
    assert (tmp_path / "never.bin").read_bytes() == never
