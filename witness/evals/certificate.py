"""Evaluation certificates: per-example results in a Merkle tree, bound to the run's final head.

A certificate holds the run's final signed tree head (whose extensions state the final state and
model hashes and the used-document tree), the evaluation set's root, every per-example result,
the aggregates, and an absence proof of every evaluation document from the used-document tree.
The evaluator signs it. ``check_certificate`` needs no model: it recomputes every aggregate and
the results tree and checks every proof; spot checks (``spot.py``) then re-run the model.
"""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..commit.hashing import canonical_json, leaf_hash, parse_hex, same
from ..commit.merkle import merkle_root
from ..commit.signing import SignedTreeHead, key_fingerprint, public_hex, public_key_from_hex
from ..commit.sorted_tree import PairProof, verify_absent
from ..data.proofs import pair_from_json, pair_to_json
from ..errors import MalformedInput, VerificationError

FORMAT = "witness-eval-certificate"
VERSION = 1
EXAMPLE_FIELDS = {"index", "sample", "loss", "prediction", "correct"}


def results_root(examples: list[dict]) -> bytes:
    """Merkle root of the per-example results, in evaluation-set order."""
    return merkle_root([leaf_hash(canonical_json(e)) for e in examples])


def sign_certificate(body: dict, key: Ed25519PrivateKey) -> dict:
    """Add the evaluator's key and signature over the canonical body."""
    body = dict(body, evaluator=public_hex(key.public_key()))
    return body | {"signature": key.sign(canonical_json(body)).hex()}


def build_body(task_name: str, head: SignedTreeHead, public_key: str, eval_set: tuple[bytes, int],
               examples: list[dict], aggregates: dict, absences: list[tuple[str, bytes, PairProof]],
               near: dict) -> dict:
    """The certificate's content before signing; ``eval_set`` is the held-out split's (root, size)."""
    eval_root, eval_size = eval_set
    return {
        "format": FORMAT,
        "version": VERSION,
        "task": task_name,
        "run": {"public_key": public_key, "tree_head": head.to_json()},
        "eval_set": {"split": "eval", "root": eval_root.hex(), "size": eval_size},
        "aggregates": aggregates,
        "results": {"root": results_root(examples).hex(), "count": len(examples), "examples": examples},
        "contamination": {
            "clean": True,
            "documents": [{"name": n, "document": h.hex(), "absence": pair_to_json(p)} for n, h, p in absences],
        },
        "near_duplicates": near,
    }


def _obj(value: Any, keys: set[str], where: str) -> dict:
    if not isinstance(value, dict) or set(value) != keys:
        raise MalformedInput(f"certificate: {where} must be an object with exactly {sorted(keys)}")
    return value


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise MalformedInput(f"certificate: {where} must be a non-negative integer")
    return value


def _float(v: Any, where: str) -> float:
    if type(v) not in (float, int):
        raise MalformedInput(f"{where} must be a number")
    return float(v)


def parse_examples(examples: Any) -> list[dict]:
    """Strictly parse the per-example results."""
    if not isinstance(examples, list):
        raise MalformedInput("results.examples must be a list")
    for k, e in enumerate(examples):
        if not isinstance(e, dict) or not {"index", "sample", "loss"} <= set(e) <= EXAMPLE_FIELDS:
            raise MalformedInput(f"example {k} has missing or unexpected fields")
        if e["index"] != k or type(e["index"]) is not int:
            raise MalformedInput(f"example {k} is out of order")
        _float(e["loss"], f"example {k}.loss")
        parse_hex(e["sample"], f"example {k}.sample")
        if ("prediction" in e) != ("correct" in e):
            raise MalformedInput(f"example {k}: prediction and correct come together")
        if "correct" in e and (type(e["correct"]) is not bool or type(e["prediction"]) is not int):
            raise MalformedInput(f"example {k}: prediction is an integer and correct a boolean")
    return examples


def check_certificate(cert: Any, aggregates_of, *, head: SignedTreeHead | None = None,
                      public_key: str | None = None, evaluator: str | None = None) -> dict:
    """Check everything that needs no model; return the parsed essentials or raise.

    ``aggregates_of(examples)`` is the task's own aggregate function, recomputed here exactly.
    ``head``/``public_key`` pin the run; ``evaluator`` pins who signed the certificate.
    """
    fields = {"format", "version", "task", "run", "eval_set", "aggregates", "results", "contamination",
              "near_duplicates", "evaluator", "signature"}
    if not isinstance(cert, dict) or cert.get("format") != FORMAT or type(cert.get("version")) is not int \
            or cert["version"] != VERSION:
        raise MalformedInput("not a witness evaluation certificate of a supported version")
    if set(cert) != fields:
        raise MalformedInput("the certificate has missing or unexpected fields")
    body = {k: v for k, v in cert.items() if k != "signature"}
    sig = parse_hex(cert["signature"], "signature", 64)
    try:
        public_key_from_hex(cert["evaluator"]).verify(sig, canonical_json(body))
    except MalformedInput:
        raise
    except Exception:
        raise VerificationError("the evaluator's signature on the certificate is invalid", check="signature") from None
    if evaluator is not None and cert["evaluator"] != evaluator:
        raise VerificationError(f"the certificate is signed by evaluator key {cert['evaluator']}, not by the "
                                f"expected key {evaluator}", check="signature")

    run = _obj(cert["run"], {"public_key", "tree_head"}, "run")
    es = _obj(cert["eval_set"], {"split", "root", "size"}, "eval_set")
    res = _obj(cert["results"], {"root", "count", "examples"}, "results")
    cont = _obj(cert["contamination"], {"clean", "documents"}, "contamination")
    if not isinstance(cert["aggregates"], dict) or not isinstance(cert["near_duplicates"], dict):
        raise MalformedInput("certificate: aggregates and near_duplicates must be objects")
    eval_root, eval_size = parse_hex(es["root"], "eval_set.root"), _count(es["size"], "eval_set.size")
    if eval_size == 0 or _count(res["count"], "results.count") == 0:
        raise MalformedInput("the certificate is of 0 evaluation examples: it certifies nothing")
    sth = SignedTreeHead.from_json(run["tree_head"])
    sth.verify(public_key_from_hex(run["public_key"]))
    if public_key is not None and run["public_key"] != public_key:
        raise VerificationError("the certificate is bound to a run signed by another key", check="binding")
    if head is not None and (head.size != sth.size or not same(head.root, sth.root)):
        raise VerificationError("the certificate is bound to another run or checkpoint (tree head "
                                f"of size {sth.size}, root {sth.root.hex()[:16]}…)", check="binding")
    ext = sth.extensions
    if not isinstance(ext, dict) or not isinstance(ext.get("used_documents"), dict):
        raise VerificationError("the certificate's tree head is not a finished run's final head", check="binding")
    used = _obj(ext["used_documents"], {"root", "size"}, "used_documents")
    root, size = parse_hex(used["root"], "used_documents.root"), _count(used["size"], "used_documents.size")
    if not isinstance(ext.get("document_rule"), str):
        raise MalformedInput("certificate: the run's final head names no document rule")
    final_state = parse_hex(ext.get("final_state_hash"), "final_state_hash")
    final_model = parse_hex(ext.get("final_model_hash"), "final_model_hash")

    examples = parse_examples(res["examples"])
    if _count(res["count"], "results.count") != len(examples):
        raise VerificationError("the results' count is not the number of examples", check="results")
    if not same(results_root(examples), parse_hex(res["root"], "results.root")):
        raise VerificationError("the per-example results do not hash to the certified results root", check="results")
    recomputed = aggregates_of(examples)
    if recomputed != cert["aggregates"]:
        diff = sorted(k for k in set(recomputed) | set(cert["aggregates"])
                      if recomputed.get(k) != cert["aggregates"].get(k))
        raise VerificationError(f"aggregate(s) {', '.join(diff)} are not those of the per-example results "
                                f"(recomputed {', '.join(f'{k}={recomputed.get(k)!r}' for k in diff)})",
                                check="aggregates")

    if cont["clean"] is not True or not isinstance(cont["documents"], list):
        raise VerificationError("the certificate does not claim a clean evaluation set", check="contamination")
    documents = []
    for k, d in enumerate(cont["documents"]):
        d = _obj(d, {"name", "document", "absence"}, f"contamination document {k}")
        if not isinstance(d["name"], str):
            raise MalformedInput(f"certificate: contamination document {k} needs a name")
        doc = parse_hex(d["document"], "document")
        proof = pair_from_json(d["absence"], size, f"contamination document {k}")
        try:
            verify_absent(doc, proof, root, size)
        except VerificationError as e:
            raise VerificationError(f"evaluation document {d['name']!r} is not proven absent from the "
                                    f"training data: {e}", check="contamination") from None
        documents.append(doc)
    if es["split"] != "eval":
        raise VerificationError("the certificate is not for the evaluation split", check="eval set")
    return {
        "head": sth, "public_key": run["public_key"], "examples": examples, "aggregates": recomputed,
        "eval_root": eval_root, "eval_size": eval_size, "documents": documents,
        "final_state_hash": final_state, "final_model_hash": final_model,
        "evaluator": key_fingerprint(cert["evaluator"]), "task": cert["task"], "document_rule": ext["document_rule"],
    }


def spot_probability(forged_fraction: float, spots: int) -> float:
    """Lower bound 1 - (1 - g)^M on catching a fraction g of forged examples with M spot checks."""
    return 1.0 - (1.0 - forged_fraction) ** spots

