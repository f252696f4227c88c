"""Interactive responses: the trainer supplies committed states and the samples of the replayed steps.

Layout of a response folder::

    response.json                       versioned, canonical JSON
    states/<step:08d>.safetensors       the committed state after <step> updates, where a
                                        challenged segment starts (and, for tolerance mode, ends)

A run that commits its dataset's leaves needs no proofs beside the samples (the verifier checks
each against its leaf). An older run's samples come with their inclusion proofs in the dataset
commitment and, for a finished run, their membership proofs in the used-data trees.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bundle.checkpoint import read_checkpoint
from ..bundle.schema import EndRecord
from ..commit.hashing import from_hex, leaf_hash, parse_canonical_json, same
from ..commit.merkle import verify_inclusion
from ..commit.sorted_tree import PairProof, verify_member
from ..data.dataset import batch_root, document_of, sample_hash
from ..data.leaves import DatasetLeaves
from ..data.proofs import pair_from_json
from ..errors import MalformedInput, VerificationError

FORMAT = "witness-response"
# What a missing answer most likely means: the response was made for another audit's challenges.
NONCE_HINT = "(was it made with witness respond --nonce and this audit's nonce?)"
VERSION = 3  # 3: no nonce field (the verifier draws from its own nonce; the field was never checked)
STATE_RE = re.compile(r"^states/([0-9]{8,12})\.safetensors$")
MAX_RESPONSE_JSON = 256 * 1024 * 1024
MAX_SAMPLE_BYTES = 1 << 20


@dataclass
class ResponseStep:
    """Samples of one step, each with its inclusion proof in the dataset commitment and (for a
    finished run) the raw JSON of its membership proofs in the used-sample and used-document trees."""

    indices: list[int]
    samples: list[bytes]
    proofs: list[list[bytes]]
    used: list | None


def safe_child(root: Path, rel: object) -> Path:
    """Resolve a relative name inside ``root``; refuse anything that could leave it."""
    if not isinstance(rel, str) or not STATE_RE.match(rel):
        raise MalformedInput(f"response names a file {rel!r} outside its states/ folder")
    path = root / rel
    st = os.lstat(path) if os.path.lexists(path) else None
    if st is None:
        raise MalformedInput(f"response is missing {rel}")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode) or stat.S_ISLNK(os.lstat(path.parent).st_mode):
        raise MalformedInput(f"{rel} is a link or not a regular file")
    return path


class Response:
    """A parsed response folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        path = self.root / "response.json"
        if not path.is_file() or path.is_symlink():
            raise MalformedInput(f"{self.root} holds no response.json")
        if path.stat().st_size > MAX_RESPONSE_JSON:
            raise MalformedInput("response.json is too large")
        try:
            obj = parse_canonical_json(path.read_bytes())
        except ValueError as e:
            raise MalformedInput(f"response.json: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or type(obj.get("version")) is not int \
                or obj["version"] != VERSION:
            raise MalformedInput("response.json is not a witness response of a supported version")
        if set(obj) != {"format", "version", "head_root", "head_size", "states", "steps"}:
            raise MalformedInput("response.json has missing or unexpected fields")
        try:
            self.head_root = from_hex(obj["head_root"], "head_root")
        except ValueError as e:
            raise MalformedInput(f"response.json: {e}") from None
        self.head_size = obj["head_size"]
        if type(self.head_size) is not int:
            raise MalformedInput("response.json: head_size must be an integer")
        if not isinstance(obj["states"], dict) or not isinstance(obj["steps"], dict):
            raise MalformedInput("response.json: states and steps must be objects")
        self.state_files = {int(k): v for k, v in obj["states"].items() if k.isdigit()}
        if len(self.state_files) != len(obj["states"]):
            raise MalformedInput("response.json: state keys must be step numbers")
        self.steps: dict[int, ResponseStep] = {}
        for k, v in obj["steps"].items():
            if not k.isdigit() or not isinstance(v, dict) or set(v) != {"indices", "samples", "proofs", "used"}:
                raise MalformedInput(f"response.json: bad entry for step {k!r}")
            if not all(isinstance(v[f], list) for f in ("indices", "samples", "proofs")) or \
                    not all(isinstance(p, list) for p in v["proofs"]):
                raise MalformedInput(f"response.json step {k}: indices, samples and proofs must be lists")
            if v["used"] is not None and (not isinstance(v["used"], list) or len(v["used"]) != len(v["samples"])):
                raise MalformedInput(f"response.json step {k}: used must be null or one entry per sample")
            try:
                samples = [bytes.fromhex(s) for s in v["samples"]]
                proofs = [[from_hex(h, "proof node") for h in p] for p in v["proofs"]]
            except (ValueError, TypeError) as e:
                raise MalformedInput(f"response.json step {k}: {e}") from None
            if any(len(s) > MAX_SAMPLE_BYTES for s in samples):
                raise MalformedInput(f"response.json step {k}: a sample is too large")
            if not all(type(i) is int for i in v["indices"]):
                raise MalformedInput(f"response.json step {k}: indices must be integers")
            self.steps[int(k)] = ResponseStep(list(v["indices"]), samples, proofs, v["used"])

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The supplied state after ``step`` updates."""
        if step not in self.state_files:
            raise MissingState(f"the response supplies no state after {step} update(s) {NONCE_HINT}", step=step,
                               check="response")
        return read_checkpoint(safe_child(self.root, self.state_files[step]))


class MissingState(VerificationError):
    """The response holds no state where the audit must start a segment."""


def _member(value: bytes, proof: object, tree, what: str, step: int, index: int) -> None:
    """``value`` must be in a committed used-data tree; the proof is parsed strictly."""
    parsed: PairProof = pair_from_json(proof, tree.size, f"response.json step {step} sample {index} {what} proof")
    try:
        verify_member(value, parsed, tree.root, tree.size)
    except VerificationError as e:
        raise VerificationError(f"sample {index} is not in the committed used-{what} tree ({e.diagnosis}): "
                                "the end record leaves out data the run trained on", step=step, check="data usage") from None


class ResponseSamples:
    """Samples from a response, each proven to be the committed dataset's sample at its index.

    A run that commits its dataset's leaves (``data_commitment`` 2) is checked against them, which
    the audit has already checked against the data root: every sample must hash to its leaf, and
    the documents its bytes name (under the task's rule) must be the ones its leaf lists. Every
    step's batch root and the used-data trees were checked in full from the same leaves, so the
    response carries no proofs. An older run's samples carry an inclusion proof in the dataset
    tree and membership proofs in the used-data trees.
    """

    def __init__(self, response: Response, data_root: bytes, dataset_size: int, end: EndRecord | None,
                 leaves: DatasetLeaves | None = None, rule: str | None = None):
        self.response, self.data_root, self.n, self.end = response, data_root, dataset_size, end
        self.leaves, self.rule = leaves, rule

    def samples(self, step: int, indices: Sequence[int], root: bytes) -> list[bytes]:
        """The batch of ``step``, every sample proven to sit at its index in the committed dataset."""
        got = self.response.steps.get(step)
        if got is None:
            raise VerificationError(f"the response supplies no samples for this step {NONCE_HINT}", step=step,
                                    check="response")
        if list(indices) != got.indices or len(got.samples) != len(indices) or len(got.proofs) != len(indices):
            raise VerificationError("the response's samples are not the committed batch", step=step, check="data")
        if self.leaves is not None:
            return self._against_leaves(step, indices, got)
        hashes = []
        for i, s, p in zip(indices, got.samples, got.proofs, strict=True):
            h = sample_hash(s)
            try:
                verify_inclusion(leaf_hash(h), i, self.n, p, self.data_root)
            except VerificationError:
                raise VerificationError(f"sample {i} is not in the committed dataset", step=step, check="data") from None
            hashes.append(h)
        if not same(batch_root(hashes), root):
            raise VerificationError("the samples do not hash to the committed batch root", step=step, check="data")
        if self.end is not None:
            if got.used is None:
                raise VerificationError("the response proves no sample's place in the used-data trees",
                                        step=step, check="data usage")
            for i, s, h, proofs in zip(indices, got.samples, hashes, got.used, strict=True):
                if not isinstance(proofs, dict) or set(proofs) != {"sample", "document"}:
                    raise MalformedInput(f"response.json step {step}: used proofs need sample and document")
                _member(h, proofs["sample"], self.end.used_samples, "sample", step, i)
                try:
                    doc = document_of(self.rule or self.end.document_rule, s)
                except ValueError as e:
                    raise VerificationError(f"sample {i}: {e}", step=step, check="data usage") from None
                _member(doc, proofs["document"], self.end.used_documents, "document", step, i)
        return got.samples

    def _against_leaves(self, step: int, indices: Sequence[int], got: ResponseStep) -> list[bytes]:
        leaves = self.leaves
        if any(p for p in got.proofs) or got.used is not None:
            raise MalformedInput(f"response.json step {step}: a run that commits its dataset's leaves needs no "
                                 "proofs (empty lists, used null)")
        for i, s in zip(indices, got.samples, strict=True):
            if not same(sample_hash(s), leaves.sample_hash(i)):  # type: ignore[union-attr]
                raise VerificationError(f"sample {i} is not the committed dataset's", step=step, check="data")
            try:
                key = document_of(self.rule, s)  # type: ignore[arg-type]
            except ValueError as e:
                raise VerificationError(f"sample {i}: {e}", step=step, check="data usage") from None
            if not same(key, leaves.key(i)):  # type: ignore[union-attr]
                raise VerificationError(f"sample {i} names other documents than the dataset's committed leaves "
                                        "list for it", step=step, check="data usage")
        return got.samples
