"""Is a released model the one a run produced? By its weights, or by its answers to the probes."""

from __future__ import annotations

import json
import os
import statistics
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..bundle.reader import Bundle, open_bundle
from ..bundle.state import model_hash
from ..commit.hashing import load_json, same
from ..errors import MalformedInput
from ..fingerprint.probes import relative_distance
from ..verify.cheap import task_of
from .weights import check_tied, read_weights

MAX_RESPONSE = 64 * 1024 * 1024


@dataclass
class Identity:
    """The answer of ``witness identify``."""

    same: bool
    method: str
    detail: str
    distance: float = 0.0
    threshold: float = 0.0
    exact: bool = True

    def to_json(self) -> dict:
        """JSON form."""
        return asdict(self)


def identify_weights(bundle: Bundle, path: str | os.PathLike) -> Identity:
    """Same model iff the weights hash to the run's final model hash; weights whose tied names (the
    task's model says which) hold different bytes are refused, even then."""
    weights = read_weights(path)
    got = model_hash(weights, bundle.manifest.state_digest)
    ok = bundle.end is not None and same(got, bundle.end.final_model_hash)
    if ok:  # another model is DIFFERENT whatever its ties; the run's own must be one model
        check_tied(bundle, weights, Path(path).name)
    return Identity(ok, "weights", f"model hash {got.hex()[:16]}… "
                    f"{'equals' if ok else 'differs from'} the run's final model hash "
                    f"{bundle.end.final_model_hash.hex()[:16] if bundle.end else '?'}…")


def calibrated_threshold(bundle: Bundle) -> float:
    """A tenth of the median fingerprint change per step over the run's last ten steps.

    A model that is not the final one but one or more training steps away from it moves the
    fingerprint by about one such step; numerical noise of other hardware is far below it.
    """
    recs = bundle.steps[-11:]
    moves = []
    for a, b in zip(recs, recs[1:], strict=False):
        moves.append(relative_distance(a.fingerprint_vector, b.fingerprint_vector))
    return 0.1 * statistics.median(moves) if moves else 1e-6


def query_endpoint(url: str, probes: list[bytes], timeout: float = 30.0) -> torch.Tensor:
    """POST the probe inputs to ``url``/v1/outputs and read the outputs back."""
    req = urllib.request.Request(url.rstrip("/") + "/v1/outputs",
                                 data=json.dumps({"inputs": [p.hex() for p in probes]}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the user names the URL)
            body = resp.read(MAX_RESPONSE + 1)
    except OSError as e:
        raise MalformedInput(f"the endpoint did not answer: {e}") from None
    if len(body) > MAX_RESPONSE:
        raise MalformedInput("the endpoint's answer is too large")
    try:
        obj = load_json(body)
        out = torch.tensor(obj["outputs"], dtype=torch.float32)
        if list(out.shape) != obj["shape"]:
            raise ValueError("shape mismatch")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # torch.tensor recurses too
        raise MalformedInput(f"the endpoint's answer is not a witness outputs document: {e}") from None
    return out


def identify_endpoint(bundle: Bundle, url: str, exact: bool = True) -> Identity:
    """Same model iff the endpoint's probe outputs give the run's last behavioral fingerprint."""
    task = task_of(bundle)
    outputs = query_endpoint(url, task.probe_bytes())
    try:
        fp = task.fingerprint_of_outputs(outputs)
    except (RuntimeError, ValueError, IndexError) as e:
        raise MalformedInput(f"the endpoint's outputs do not fit the task's probes: {e}") from None
    last = bundle.steps[-1]
    want = last.fingerprint_vector
    got = fp.vector()
    distance = relative_distance(got, want)
    threshold = calibrated_threshold(bundle)
    digest_equal = fp.digest == last.digest.hex()
    ok = digest_equal if exact else distance <= threshold
    detail = (f"probe outputs {'match' if digest_equal else 'do not match'} the final fingerprint bit for bit; "
              f"distance {distance:.3g} against the calibrated threshold {threshold:.3g}")
    return Identity(ok, "endpoint", detail, distance, threshold, exact)


def identify(bundle_dir: str | os.PathLike, *, weights: str | None = None, endpoint: str | None = None,
             exact: bool = True) -> Identity:
    """Identify a released model against a finished run."""
    bundle = open_bundle(bundle_dir)
    if bundle.end is None:
        raise MalformedInput("identification needs a finished run")
    if (weights is None) == (endpoint is None):
        raise MalformedInput("give exactly one of --weights or --endpoint")
    if weights is not None:
        return identify_weights(bundle, weights)
    return identify_endpoint(bundle, endpoint, exact)  # type: ignore[arg-type]

