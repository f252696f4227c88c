"""Data-usage proofs: "document x was used, in these steps" and "document x was never used".

A proof is a small versioned JSON file that checks against the run's public commitments alone
(a signed tree head and the trainer's public key), without the model, the data or the
checkpoints:

* the run's final signed tree head, whose signed extensions state the root and size of the
  sorted tree of used documents (the same values the log's end record holds);
* that head names the run's task (since witness 0.5): the task, never the run, decides what a
  document is (its document rule), so the checker takes the rule from the registered task of
  that name and refuses a head that claims another (an audit holds the head's task to the
  manifest's);
* inclusion: the document's leaf in that tree, and every step that used it — the step record
  with its log inclusion proof, the sample's canonical bytes (which name its documents), the list
  of those documents where the sample spans several, and the sample's path to the record's
  batch root;
* exclusion: the leaf of the used-document tree whose two adjacent values bracket the document,
  with its audit path.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..commit.hashing import canonical_json, leaf_hash, parse_hex, same
from ..commit.log import RunLog
from ..commit.merkle import MerkleTree, verify_inclusion
from ..commit.signing import SignedTreeHead, key_fingerprint, public_key_from_hex
from ..commit.sorted_tree import PairProof, verify_absent, verify_member
from ..errors import MalformedInput, VerificationError
from .dataset import Dataset, document_of, sample_hash
from .leaves import documents_key
from .usage import UsageCommitment

FORMAT = "witness-data-proof"
VERSION = 2  # 2: every use lists the documents of its sample (a window may span several)
MAX_PROOF_BYTES = 64 * 1024 * 1024


@dataclass
class RunCommitments:
    """What a prover needs from a finished run to answer data queries."""

    public_key: str
    head: SignedTreeHead
    log: RunLog
    end: dict
    steps: list[dict]
    dataset: Dataset
    usage: UsageCommitment


def pack(hashes: list[bytes]) -> str:
    """A list of 32-byte hashes as one base64 string (proofs stay small)."""
    return base64.b64encode(b"".join(hashes)).decode()


def unpack(value: Any, where: str, limit: int = 256) -> list[bytes]:
    """Strictly decode a packed hash list."""
    if not isinstance(value, str) or len(value) > limit * 44:
        raise MalformedInput(f"{where}: must be a base64 string of at most {limit} hashes")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise MalformedInput(f"{where}: not base64") from None
    if len(raw) % 32 or base64.b64encode(raw).decode() != value:
        raise MalformedInput(f"{where}: not a canonical list of 32-byte hashes")
    return [raw[i : i + 32] for i in range(0, len(raw), 32)]


def _version(run: RunCommitments) -> int:
    # a run before witness 0.5 has a head that names no task: its proofs stay version 1
    return VERSION if isinstance(run.head.extensions, dict) and "task" in run.head.extensions else 1


def _header(run: RunCommitments, kind: str, document: bytes) -> dict:
    return {
        "format": FORMAT,
        "version": _version(run),
        "kind": kind,
        "document": document.hex(),
        "public_key": run.public_key,
        "tree_head": run.head.to_json(),
    }


def pair_to_json(p: PairProof) -> dict:
    """The JSON form of a sorted-tree leaf proof."""
    return {"index": p.index, "lower": p.lower.hex() if p.lower else None,
            "upper": p.upper.hex() if p.upper else None, "path": pack(p.path)}


def pair_from_json(obj: Any, size: int, where: str) -> PairProof:
    """Strictly parse a sorted-tree leaf proof for a tree of ``size`` committed values."""
    if not isinstance(obj, dict) or set(obj) != {"index", "lower", "upper", "path"}:
        raise MalformedInput(f"{where}: needs exactly index, lower, upper, path")
    ends = [None if obj[k] is None else parse_hex(obj[k], f"{where}.{k}") for k in ("lower", "upper")]
    return PairProof(_get(obj, "index", int, where), ends[0], ends[1], size, unpack(obj["path"], f"{where}.path"))


def prove_inclusion(run: RunCommitments, document: bytes) -> dict:
    """Inclusion proof for a used document; ValueError if the run never used it."""
    member = run.usage.documents.prove_member(document)
    uses = []
    leaves = run.dataset.leaves
    for rec in run.steps:
        batch = rec["batch"]
        positions = [j for j, i in enumerate(batch) if document in leaves.documents(i)]
        if not positions:
            continue
        j = positions[0]  # one sample per step shows the step used the document
        tree = MerkleTree([leaf_hash(leaves.sample_hash(i)) for i in batch])
        t = rec["step"]
        uses.append({
            "step": t,
            "record": rec,
            "log_proof": pack(run.log.tree.inclusion_proof(t + 1, run.head.size)),
            "position": j,
            "sample": run.dataset.sample_bytes(batch[j]).hex(),
            "batch_proof": pack(tree.inclusion_proof(j)),
        } | ({"documents": pack(leaves.documents(batch[j]))} if _version(run) >= 2 else {}))
    doc = _header(run, "inclusion", document)
    doc["member"] = pair_to_json(member)
    doc["uses"] = uses
    return doc


BYTES_ONLY = ("these bytes are not one of the run's dataset's documents (as its maker found): the proof covers "
              "exactly these bytes as a whole document, not a fragment of a used document or a window shifted "
              "against the dataset's")


def prove_exclusion(run: RunCommitments, document: bytes, bytes_only: bool = False) -> dict:
    """Exclusion proof for a document the run never used; ValueError if it was used. ``bytes_only``: the bytes
    are no document of the run's dataset, and the proof says so (``scope: bytes``), its caveat with it."""
    absent = run.usage.documents.prove_absent(document)
    doc = _header(run, "exclusion", document)
    doc["absence"] = pair_to_json(absent)
    if bytes_only:
        doc["scope"] = "bytes"
    return doc


# --- checking -----------------------------------------------------------------------------

def _get(obj: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj or not isinstance(obj[key], kind) or \
            (kind is int and isinstance(obj[key], bool)):
        raise MalformedInput(f"{where}: missing or ill-typed field {key!r}")
    return obj[key]


RuleOf = Callable[[str], str]


def check_proof(proof: Any, *, document_rule: str | RuleOf, head: SignedTreeHead | None = None,
                public_key: str | None = None) -> dict:
    """Check a data proof against the public commitments; returns a summary or raises.

    ``document_rule`` is the rule of the run's task (what a document is): the rule itself, or a
    function from the task's name, which the final head of a run since witness 0.5 signs, to its
    rule.
    The head's claimed rule must be it. ``head`` and ``public_key`` pin what the checker trusts
    (a published head, the trainer's key); without them the proof's own head and key are used,
    and reported.
    """
    if not isinstance(proof, dict) or proof.get("format") != FORMAT or type(proof.get("version")) is not int \
            or proof["version"] not in (1, VERSION):
        raise MalformedInput("not a witness data proof of a supported version")
    version = proof["version"]
    kind = _get(proof, "kind", str, "proof")
    allowed = {"format", "version", "kind", "document", "public_key", "tree_head"}
    allowed |= {"member", "uses"} if kind == "inclusion" else {"absence"} if kind == "exclusion" else set()
    if kind == "exclusion" and "scope" in proof:  # its maker's caveat: the bytes are no document of the dataset
        if proof["scope"] != "bytes":
            raise MalformedInput("an exclusion proof's scope is \"bytes\" where it names one")
        allowed |= {"scope"}
    if kind not in ("inclusion", "exclusion") or set(proof) != allowed:
        raise MalformedInput("the proof has missing or unexpected fields")
    document = parse_hex(proof["document"], "document")
    key_hex = _get(proof, "public_key", str, "proof")
    if public_key is not None and key_hex != public_key:
        raise VerificationError("the proof is signed by another key than the pinned one", check="signature")
    sth = SignedTreeHead.from_json(proof["tree_head"])
    sth.verify(public_key_from_hex(key_hex))
    if head is not None and (head.size != sth.size or not same(head.root, sth.root)):
        raise VerificationError(f"the proof is for the tree head of size {sth.size}, not the pinned one "
                                f"of size {head.size}", check="tree head")

    ext = sth.extensions
    if not isinstance(ext, dict) or not isinstance(ext.get("used_documents"), dict):
        raise VerificationError("the tree head is not a finished run's final head (no used-data commitment)",
                                check="tree head")
    used = ext["used_documents"]
    root, size = parse_hex(used.get("root"), "used_documents.root"), _get(used, "size", int, "used_documents")
    claimed = _get(ext, "document_rule", str, "extensions")
    task = ext.get("task")
    if task is not None and not isinstance(task, str):
        raise MalformedInput("the tree head's task is not a name")
    if (version >= 2) != (task is not None):  # the release that signs the task writes version 2
        raise MalformedInput(f"a version {version} proof cannot be of a run whose head "
                             f"{'names' if task is not None else 'does not name'} its task")
    if isinstance(document_rule, str):
        rule = document_rule
    elif task is None:
        raise MalformedInput("the run's head does not name its task (a run before witness 0.5), whose rule "
                             "decides what a document is: check the proof against the run's bundle")
    else:
        rule = document_rule(task)
    if claimed != rule:
        raise VerificationError(f"the run's head gives documents under rule {claimed!r}, but its task "
                                f"{task or 'the run names'!r} decides rule {rule!r}: the task, never the run, says "
                                "what a document is", check="data usage")

    summary = {"kind": kind, "document": document.hex(), "signer": key_fingerprint(key_hex),
               "tree_head": sth.to_json(), "used_documents": size, "document_rule": rule}
    if task is not None:
        summary["task"] = task
    if kind == "exclusion":
        verify_absent(document, pair_from_json(proof["absence"], size, "absence"), root, size)
        if "scope" in proof:
            summary["scope"] = BYTES_ONLY
        return summary

    verify_member(document, pair_from_json(proof["member"], size, "member"), root, size)
    uses = _get(proof, "uses", list, "proof")
    if not uses:
        raise VerificationError("an inclusion proof must show at least one step that used the document", check="proof")
    steps = []
    for k, use in enumerate(uses):
        where = f"uses[{k}]"
        fields = {"step", "record", "log_proof", "position", "sample", "batch_proof"} | ({"documents"} if version >= 2 else set())
        if not isinstance(use, dict) or set(use) != fields:
            raise MalformedInput(f"{where}: needs exactly {sorted(fields)}")
        t = _get(use, "step", int, where)
        rec = _get(use, "record", dict, where)
        if rec.get("type") != "step" or rec.get("step") != t or not 0 <= t < sth.size - 2:
            raise VerificationError(f"{where} is not the record of step {t}", check="proof")
        verify_inclusion(leaf_hash(canonical_json(rec)), t + 1, sth.size, unpack(use.get("log_proof"), where), sth.root)
        try:
            sample = bytes.fromhex(_get(use, "sample", str, where))
        except ValueError:
            raise MalformedInput(f"{where}: sample is not hex") from None
        batch = _get(rec, "batch", list, where)
        j = _get(use, "position", int, where)
        if not 0 <= j < len(batch):
            raise VerificationError(f"{where}: position {j} is outside the batch", check="proof")
        try:
            verify_inclusion(leaf_hash(sample_hash(sample)), j, len(batch), unpack(use.get("batch_proof"), where),
                             parse_hex(rec.get("batch_root"), "batch_root"))
        except VerificationError:
            raise VerificationError(f"step {t}: the sample is not in the step's batch", check="proof") from None
        try:
            key = document_of(rule, sample)
        except ValueError as e:
            raise VerificationError(f"step {t}: {e}", check="proof") from None
        # the sample's bytes name its documents by their key; a window that spans several lists them
        documents = unpack(use["documents"], f"{where}.documents", 65535) if version >= 2 else [key]
        if not same(documents_key(documents), key) or document not in documents:
            raise VerificationError(f"step {t}: the sample belongs to another document", check="proof")
        steps.append(t)
    if len(set(steps)) != len(steps):
        raise VerificationError("a step is listed twice", check="proof")
    summary["steps"] = steps
    return summary
