"""Run the certified final model on the committed evaluation split, and spot-check certificates."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from ..bundle.reader import Bundle, as_bundle, open_bundle
from ..bundle.state import load_state
from ..commit.hashing import canonical_json, same, tagged_hash
from ..data.dataset import Dataset
from ..data.locate import no_pins
from ..errors import RunRejected, VerificationError
from ..task.base import Task
from ..verify.challenges import WEAK_BOUND, sample_indices, weak_bound_warning
from ..verify.cheap import task_of
from ..verify.data_queries import run_commitments
from ..verify.usage import check_data_usage, check_document_rule, committed_leaves
from ..verify.verdict import percent_down
from .certificate import build_body, check_certificate, sign_certificate, spot_probability
from .contamination import absence_proofs
from .release import final_model_tensors


def final_model(bundle: Bundle, task: Task) -> torch.nn.Module:
    """The run's final model, from its final checkpoint (whose hash the log commits)."""
    model = task.build_model(bundle.manifest.run_seed)
    load_state(model, None, final_model_tensors(bundle, "a final model to evaluate"))
    model.eval()
    return model


def evaluate(bundle_dir: str | os.PathLike, key: Ed25519PrivateKey, progress: bool = True) -> dict:
    """Evaluate the final model on every example of the evaluation split; return a signed certificate."""
    bundle = open_bundle(bundle_dir)
    run, task = run_commitments(bundle)  # the training data: found by its content or root, wherever it lies
    eval_set = evaluation_split(task)
    if len(eval_set) == 0:
        raise ValueError(f"task {task.name!r} has no evaluation split (its make_eval_dataset or eval_dataset gives "
                         "0 examples): there is nothing to certify")
    # near duplicates from the committed training data, where it was found
    absences, near = absence_proofs(eval_set.documents_list(), run.usage.documents, run.dataset.documents_list())

    model = final_model(bundle, task)
    examples = []
    for i in tqdm(range(len(eval_set)), desc="evaluating", unit="example", disable=not progress):
        sample = eval_set.sample_bytes(i)
        examples.append({"index": i, "sample": eval_set.hashes[i].hex(), **task.eval_example(model, sample)})
    body = build_body(task.name, bundle.final_head, bundle.manifest.public_key, (eval_set.root, len(eval_set)),
                      examples, task.aggregates(examples), absences, near)
    return sign_certificate(body, key)


@dataclass
class EvalVerdict:
    """Outcome of ``verify-eval``."""

    accepted: bool
    mode: str
    exact: bool
    challenges: int
    bad_fraction: float
    detection_probability: float
    aggregates: dict
    contamination_clean: bool
    eval_documents: int
    evaluator: str
    nonce: str
    failures: list[str] = field(default_factory=list)
    spot_checked: list[int] = field(default_factory=list)
    near_duplicates: dict = field(default_factory=dict)
    verify_seconds: float = 0.0
    signer_key: str | None = None  # the key (hex) whose signature on the certificate was checked, where known
    signer_pinned_by: str | None = None  # what pins it (--signer, the run's key); None: nothing does

    @property
    def floor(self) -> float:
        """The bound below which an accepted check is weak (as ``verify``'s, when no confidence was asked)."""
        return WEAK_BOUND

    @property
    def outcome(self) -> str:
        """accepted, weak (its spot checks' bound below ``floor``) or rejected."""
        return "rejected" if not self.accepted else "weak" if self.detection_probability < self.floor else "accepted"

    def to_json(self) -> dict:
        """The ``--json`` form."""
        return asdict(self) | {"verdict": self.outcome}

    def summary(self) -> str:
        """Readable lines."""
        lines = [f"{'ACCEPTED' if self.accepted else 'REJECTED'}: evaluation certificate signed by {self.evaluator}",
                 *([f"  signed by key {self.signer_key} ("
                    f"{f'pinned by {self.signer_pinned_by}' if self.signer_pinned_by else 'which nothing pins'})"]
                   if self.signer_key else []),
                 f"  aggregates (recomputed exactly): {canonical_json(self.aggregates).decode()}",
                 f"  contamination: all {self.eval_documents} evaluation documents proven absent from the training data",
                 f"  spot checks: {self.challenges} example(s) re-run; had >= {100 * self.bad_fraction:g}% of the "
                 f"results been forged, this catches it with probability >= {percent_down(self.detection_probability)}%",
                 f"  near-duplicates (information only): {self.near_duplicates.get('shared_fraction', 0):.4f} of "
                 "long evaluation n-grams also occur in used training documents"]
        warning = weak_bound_warning(self.detection_probability, self.bad_fraction, flag="--spot", bad="forged results")
        if warning:
            lines.insert(1, f"  {warning}")
        lines += [f"  FAILED: {f}" for f in self.failures]
        return "\n".join(lines)


def name_signer(verdict: EvalVerdict, cert: dict, run_key: str, pinned: str | None = None) -> bool:
    """Name in ``verdict`` who made the certificate: its evaluator, whose signature on the certificate
    ``check_certificate`` verified (an envelope around it is only a carrier: anyone may re-wrap a
    certificate in an envelope of their own key), and what pins that key (``--signer``, the run's own
    key, or nothing). Whether anything pins it."""
    key = cert["evaluator"]
    verdict.signer_key = key
    verdict.signer_pinned_by = "--signer" if pinned is not None and key == pinned else \
        "the run's key" if key == run_key else None
    return verdict.signer_pinned_by is not None


def evaluation_split(task: Task) -> Dataset:
    """The task's evaluation split, from this machine's own data, by the names the recipe reads: never
    by a run's pinned content or a certificate's root, which the trainer chose (the split it would be
    scored on). Its files are looked up in the --data folders, then WITNESS_DATA, then here."""
    with no_pins():
        return task.eval_dataset()


def certified_split(task: Task, root: bytes, size: int) -> Dataset:
    """The evaluation split here, which must be the one the certificate names."""
    eval_set = evaluation_split(task)
    if not same(root, eval_set.root) or size != len(eval_set):
        raise VerificationError("the certificate's evaluation set is not the task's evaluation split here (the "
                                "one the recipe's names find in the --data folders)", check="eval set")
    return eval_set


def draw_spots(signature: str, nonce: bytes, n: int, m: int) -> list[int]:
    """M distinct example indices from H(certificate signature || nonce)."""
    return sample_indices(tagged_hash("witness/spot/v1", bytes.fromhex(signature), nonce), n, m)


def verify_eval(cert: dict, bundle_dir: str | os.PathLike | Bundle, *, spots: int = 100, forged_fraction: float = 0.05,
                nonce: bytes | None = None, exact: bool = True, rtol: float = 1e-4,
                evaluator: str | None = None) -> EvalVerdict:
    """Check a certificate in full against its bundle (and pinned ``evaluator``), then re-run M random examples."""
    started = time.perf_counter()
    bundle = as_bundle(bundle_dir)
    task = task_of(bundle)
    c = check_certificate(cert, task.aggregates, head=bundle.final_head, public_key=bundle.manifest.public_key,
                          evaluator=evaluator)
    if c["task"] != task.name:
        raise VerificationError(f"the certificate names task {c['task']!r}; the run is {task.name!r}", check="binding")
    # The absence proofs are against the run's used-document tree, under the run's claimed rule:
    # the rule must be the task's, and the tree (rebuilt from the dataset's leaves, where the
    # bundle carries them) the one the run's batches give.
    check_document_rule(c["document_rule"], task, "the run's final head")
    check_data_usage(bundle, task, committed_leaves(bundle, task) if bundle.leaves is not None else None)
    eval_set = certified_split(task, c["eval_root"], c["eval_size"])
    if len(c["examples"]) != len(eval_set):
        raise VerificationError("the certificate leaves out evaluation examples", check="eval set")
    for e, h in zip(c["examples"], eval_set.hashes, strict=True):
        if e["sample"] != h.hex():
            raise VerificationError(f"example {e['index']} is not the evaluation set's sample", check="eval set")
    if [h for _, h, _ in eval_set.documents_list()] != c["documents"]:
        raise VerificationError("the contamination proofs do not cover exactly the evaluation documents",
                                check="contamination")
    nonce = os.urandom(16) if nonce is None else nonce
    picked = draw_spots(cert["signature"], nonce, len(eval_set), spots)
    verdict = EvalVerdict(False, "spot-check", exact, len(picked), forged_fraction,
                          spot_probability(forged_fraction, len(picked)), c["aggregates"], True,
                          len(c["documents"]), c["evaluator"], nonce.hex(), spot_checked=picked,
                          near_duplicates={k: v for k, v in cert["near_duplicates"].items()
                                           if k != "documents_mostly_shared"} if isinstance(cert["near_duplicates"], dict) else {})
    model = final_model(bundle, task)
    for i in picked:
        got = task.eval_example(model, eval_set.sample_bytes(i))
        claimed = {k: v for k, v in c["examples"][i].items() if k not in ("index", "sample")}
        if exact:
            ok = got == claimed
        else:
            ok = abs(got["loss"] - claimed["loss"]) <= rtol * max(abs(claimed["loss"]), 1e-12) and \
                all(got[k] == claimed.get(k) for k in got if k != "loss")
        if not ok:
            verdict.failures.append(f"example {i}: spot check: the model gives {canonical_json(got).decode()}, "
                                    f"the certificate claims {canonical_json(claimed).decode()}")
    verdict.verify_seconds = time.perf_counter() - started
    verdict.accepted = not verdict.failures
    if verdict.failures:
        raise RunRejected(verdict.failures, verdict)
    return verdict

