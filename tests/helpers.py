"""Helpers shared by the tests: honest and dishonest runs of the small tasks, and what a dishonest
trainer (who holds its own key) can write: re-signed logs and responses of its own making."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from witness.bundle.checkpoint import save_checkpoint
from witness.bundle.layout import LOG
from witness.bundle.reader import open_bundle
from witness.bundle.schema import HEAD_EXTENSION_FIELDS
from witness.bundle.state import state_tensors
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.log import RunLog
from witness.commit.signing import generate_key
from witness.commit.sorted_tree import SortedTree
from witness.data.proofs import pair_to_json
from witness.record import Commitments, Recorder, SelfChecking, Training
from witness.session import TrainingSession
from witness.task import build_task
from witness.verify.response import FORMAT, VERSION

TINY = {"steps": 40}


def train_tiny(out: Path, key=None, *, r: bytes = b"\x07" * 32, checkpoint_every: int = 10,
               config: dict | None = None, cheat: Callable | None = None, task: str = "tiny",
               state_every: int = 1, session: TrainingSession | None = None) -> Path:
    """Train a small task; ``cheat(rec, t, batch) -> StepOutput | None`` may replace any step."""
    t_ = build_task(task, dict(TINY, **(config or {})))
    rec = Recorder.create(t_, out, key or generate_key(), r=r,
                          commit=Commitments(checkpoint_every=checkpoint_every, state_every=state_every),
                          training=Training(session=session,
                                            parallelism="none" if session is None else session.parallelism),
                          self_check=SelfChecking(enabled=cheat is None))  # a cheat would stop at its own self-check
    for t in range(t_.config.steps):
        batch = rec.batch(t)
        out_ = cheat(rec, t, batch) if cheat else None
        if out_ is None:
            out_ = t_.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        rec.log_step(t, out_)
    rec.finish()
    return out


def snapshot(rec) -> dict[str, torch.Tensor]:
    """A copy of the recorder's whole training state as it is now."""
    return {k: v.clone() for k, v in state_tensors(rec.model, rec.optimizer).items()}


def log_lines(bundle: Path) -> list[bytes]:
    """The log's records, as canonical lines."""
    return (bundle / LOG).read_bytes().split(b"\n")[:-1]


def resign(bundle: Path, key, lines: list[bytes]) -> None:
    """What a trainer holding its own key can do: rewrite the log and sign it all again (a head
    after the manifest, after every checkpoint record, and after the end record)."""
    (bundle / LOG).write_bytes(b"".join(line + b"\n" for line in lines))
    log = RunLog()
    heads = []
    for line in lines:
        log.append_line(line)
        rec = parse_canonical_json(line)
        if rec["type"] == "manifest" or "checkpoint_sha256" in rec:
            heads.append(canonical_json(log.sign_head(key).to_json()))
        elif rec["type"] == "end":
            ext = {k: rec[k] for k in HEAD_EXTENSION_FIELDS if k in rec}
            heads.append(canonical_json(log.sign_head(key, extensions=ext).to_json()))
    (bundle / "heads.jsonl").write_bytes(b"".join(h + b"\n" for h in heads))


def edit_manifest(bundle: Path, key, **changes) -> None:
    """Change manifest fields (``None`` deletes one) and re-sign the whole log."""
    lines = log_lines(bundle)
    m = parse_canonical_json(lines[0])
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    resign(bundle, key, [canonical_json(m)] + lines[1:])


def attacker_response(bundle_dir: Path, out: Path, states: dict[int, dict[str, torch.Tensor]],
                      used_samples: SortedTree | None = None, used_documents: SortedTree | None = None) -> Path:
    """A well-formed response of the trainer's own making: the given states, and every step's
    samples (for a run before the dataset's leaves were committed: with their dataset proofs and
    proofs into the used-data trees it committed, where a sample left out of those trees gets the
    proof of the leaf where it would be: the best it can do)."""
    bundle = open_bundle(bundle_dir)
    m = bundle.manifest
    task = build_task(m.task, m.task_config)
    ds = task.dataset()
    (out / "states").mkdir(parents=True, exist_ok=True)
    names = {}
    for step, tensors in states.items():
        name = f"states/{step:08d}.safetensors"
        save_checkpoint(out / name, tensors, step, m.state_digest)
        names[str(step)] = name
    proven = m.data_commitment < 2  # a run that commits its dataset's leaves is checked against them
    if used_samples is None:
        used_samples = SortedTree(ds.hashes[i] for r in bundle.steps for i in r.batch)
        used_documents = SortedTree(ds.document_of(ds.sample_bytes(i)) for r in bundle.steps for i in r.batch)

    def proof(tree: SortedTree, value: bytes) -> dict:
        return pair_to_json(tree.prove_member(value) if value in tree else tree.prove_absent(value))

    steps = {}
    for rec in bundle.steps:
        idx = list(rec.batch)
        samples = [ds.sample_bytes(i) for i in idx]
        steps[str(rec.step)] = {
            "indices": idx, "samples": [s.hex() for s in samples],
            "proofs": [[h.hex() for h in ds.tree.inclusion_proof(i)] if proven else [] for i in idx],
            "used": [{"sample": proof(used_samples, ds.hashes[i]), "document": proof(used_documents, ds.document_of(s))}
                     for i, s in zip(idx, samples, strict=True)] if proven else None,
        }
    doc = {"format": FORMAT, "version": VERSION, "head_root": bundle.final_head.root.hex(),
           "head_size": bundle.final_head.size, "states": names, "steps": steps}
    (out / "response.json").write_bytes(canonical_json(doc))
    return out


def resign_certificate(cert: dict, key) -> dict:
    """An evaluation certificate with its body (possibly edited) signed again by ``key``."""
    from witness.evals.certificate import sign_certificate

    return sign_certificate({k: v for k, v in cert.items() if k not in ("signature", "evaluator")}, key)


# A statistical test fails in one run in 1/FALSE_ALARM at most when the code is right: the
# challenges are drawn from the run's signed head, and every run signs with a fresh key, so each
# CI run draws afresh. A 4-sigma window failed about one run in a thousand across the suite.
FALSE_ALARM = 1e-9


def binomial_tails(hits: int, trials: int, p: float) -> tuple[float, float]:
    """P(X <= hits) and P(X >= hits) for X ~ Binomial(trials, p), exactly (from log-probabilities)."""
    if not 0 < p < 1:
        raise ValueError("p must lie strictly between 0 and 1")
    logs = [math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
            + k * math.log(p) + (trials - k) * math.log1p(-p) for k in range(trials + 1)]
    pmf = [math.exp(x) for x in logs]
    return math.fsum(pmf[:hits + 1]), math.fsum(pmf[hits:])


def assert_binomial(hits: int, trials: int, p: float, alpha: float = FALSE_ALARM) -> None:
    """Fail only if ``hits`` of ``trials`` lies in a tail that a Binomial(trials, p) count reaches with
    probability below ``alpha`` (two-sided)."""
    low, high = binomial_tails(hits, trials, p)
    assert min(low, high) >= alpha / 2, (f"{hits}/{trials} = {hits / trials:.4f} against p = {p:.4f}: "
                                         f"tail probability {min(low, high):.3g}")


def nonce_drawing_elsewhere(bundle: Path, nonce: bytes, q: int) -> bytes:
    """A nonce whose ``q`` challenges include a step that ``nonce``'s do not: a response made for
    ``nonce`` cannot answer that audit (a random other nonce draws a subset now and then)."""
    from witness.verify.challenges import draw_challenges

    opened = open_bundle(bundle)
    n = len(opened.steps)
    answered = {c.step for c in draw_challenges(opened.final_head, nonce, n, q)}
    return next(other for other in (i.to_bytes(2, "big") for i in range(1 << 16))
                if {c.step for c in draw_challenges(opened.final_head, other, n, q)} - answered)


def with_beacon(folder: Path, train: Callable[[str], None]) -> str:
    """Run ``train(url)`` against a beacon served on loopback for it; returns the beacon's public key."""
    from witness.beacon.app import create_app
    from witness.commit.signing import public_hex
    from witness.web import start_uvicorn, stop_uvicorn

    key = generate_key()
    server, thread, url = start_uvicorn(create_app(f"sqlite:///{folder / 'beacon.db'}", key))
    try:
        train(url)
    finally:
        stop_uvicorn(server, thread)
    return public_hex(key.public_key())
