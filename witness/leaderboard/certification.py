"""The server's signed decisions: an in-toto Statement in a DSSE envelope for every verdict.

A leaderboard page is only as good as the server that shows it. Each decision (a run certified
or rejected at submission, a re-challenge passed, a certification revoked) is signed with the
server's own Ed25519 key, so anyone holding that public key can check it offline, long after
the page is gone. The subject is the run's released model file, by SHA-256 (the submission
archive when the run never got far enough to have one); the predicate holds the verdict, the
challenges the server drew and replayed, and the detection bound.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..commit.dsse import PREDICATE_BASE, envelope, open_envelope, statement
from ..commit.hashing import canonical_json, load_json
from ..errors import MalformedInput, VerificationError
from .board import append_decision

PREDICATE_TYPE = f"{PREDICATE_BASE}/leaderboard-certification/v1"
MAX_CERTIFICATION_BYTES = 16 * 1024 * 1024
DECISIONS = ("certified", "rejected", "revoked")


def sign_decision(key, subjects: list[dict], predicate: dict) -> str:  # noqa: ANN001 - Ed25519 private key
    """The DSSE envelope of one decision, as the JSON text the server stores and serves."""
    stmt = statement(subjects, "leaderboard-certification/v1", predicate)
    return canonical_json(envelope(stmt, key)).decode()


@dataclass
class Certification:
    """A checked certification: who decided what about which run."""

    decision: str
    predicate: dict
    subjects: list[dict]

    @property
    def accepted(self) -> bool:
        """The server certified the run (a rejection or revocation is a valid statement, too)."""
        return self.decision == "certified"

    def summary(self) -> str:
        """Readable lines."""
        p = self.predicate
        run, bound = p["run"], p["bound"]
        names = ", ".join(f"{s.get('name')} (SHA-256 {s.get('digest', {}).get('sha256')})" for s in self.subjects)
        lines = [f"{self.decision.upper()}: run #{run.get('id')} on track {run.get('track')!r}, signed by the server "
                 f"key {p['server']['public_key'][:16]}…",
                 f"  subject: {names}",
                 f"  trainer key {str(run.get('trainer_key'))[:16]}…, {run.get('steps')} steps, final tree head "
                 f"size {run.get('final_size')} root {run.get('final_root')}"]
        if p.get("round"):
            rnd = p["round"]
            lines.append(f"  round {rnd.get('id')} ({rnd.get('kind')}): {rnd.get('count')} challenge(s) drawn by the "
                         f"server (nonce {rnd.get('nonce')}), {'all matched' if rnd.get('passed') else 'FAILED'}")
        if isinstance(bound.get("all_rounds"), (int, float)):
            lines.append(f"  bound: had >= {100 * bound['bad_fraction']:g}% of the steps been bad, the challenges "
                         f"passed would have caught it with probability >= {100 * bound['all_rounds']:.4f}%")
        if p.get("evaluation"):
            lines.append(f"  evaluation: {canonical_json(p['evaluation'].get('aggregates')).decode()}")
        if p.get("reason"):
            lines.append(f"  reason: {p['reason']}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The ``--json`` form."""
        return {"decision": self.decision, "accepted": self.accepted, "subjects": self.subjects,
                "predicate": self.predicate}


def check_certification(env: Any, server_key: str) -> Certification:
    """Check a certification envelope against the server's public key (raw hex); parse its decision."""
    stmt = open_envelope(env, server_key)  # only a signature by this key counts
    if stmt.get("predicateType") != PREDICATE_TYPE:
        raise MalformedInput(f"not a leaderboard certification (predicate type {stmt.get('predicateType')!r})")
    p, subjects = stmt.get("predicate"), stmt.get("subject")
    if not isinstance(p, dict) or not isinstance(subjects, list) or not subjects:
        raise MalformedInput("the certification has no predicate or no subject")
    for sub in subjects:
        digest = sub.get("digest") if isinstance(sub, dict) else None
        if not isinstance(sub.get("name") if isinstance(sub, dict) else None, str) or not isinstance(digest, dict) \
                or not isinstance(digest.get("sha256"), str) or len(digest["sha256"]) != 64:
            raise MalformedInput("a subject of the certification is not a file named by its SHA-256")
    for field, kind in (("server", dict), ("run", dict), ("decision", str), ("bound", dict), ("challenges", list)):
        if not isinstance(p.get(field), kind):
            raise MalformedInput(f"the certification's predicate has no valid {field!r}")
    if p["server"].get("public_key") != server_key:
        raise VerificationError("the certification names another server key than the one that signed it",
                                check="signature")
    if p["decision"] not in DECISIONS:
        raise MalformedInput(f"unknown decision {p['decision']!r}")
    return Certification(p["decision"], p, subjects)


def read_certification(path: str | os.PathLike) -> Any:
    """A certification file: bounded, strict JSON."""
    p = Path(path)
    if not p.is_file() or p.stat().st_size > MAX_CERTIFICATION_BYTES:
        raise MalformedInput(f"{p} is not a certification file of at most {MAX_CERTIFICATION_BYTES} bytes")
    try:
        return load_json(p.read_bytes())
    except ValueError:
        raise MalformedInput(f"{p} is not JSON") from None


def record_decision(lb, s, run, rnd=None, verdict=None, bundle=None, subjects=None) -> str:  # noqa: ANN001 - server objects
    """Sign the run's current decision (after this round, if any) and keep it on the run and the round.

    ``subjects`` names what was decided on where the run has neither a model nor a submission yet
    (a step replayed while the run trained: the uploaded state it failed from)."""
    from ..store import model_key
    from .db import Account, ChallengeRow, Track

    acct, track = s.get(Account, run.account_id), s.get(Track, run.track)
    if subjects:
        pass
    elif lb.store.exists(model_key(run.id)):
        subjects = [{"name": f"run-{run.id}-model.safetensors", "digest": {"sha256": lb.store.sha256(model_key(run.id))}}]
    elif run.bundle_sha256:  # refused before it had a model: the statement names what was submitted
        subjects = [{"name": f"run-{run.id}-submission.tar", "digest": {"sha256": run.bundle_sha256}}]
    else:
        raise ValueError(f"run {run.id} has neither a model file nor a submission to name")
    challenges = []
    if rnd is not None:
        rows = s.query(ChallengeRow).filter(ChallengeRow.round_id == rnd.id).order_by(ChallengeRow.step)
        challenges = [{"step": c.step, "length": c.length, "passed": c.passed} for c in rows]
    summary = None
    if verdict is not None:
        summary = {k: v for k, v in verdict.to_json().items() if k != "results"}
    evaluation = None
    if run.aggregates_json:
        evaluation = {"aggregates": json.loads(run.aggregates_json), "metric": track.metric,
                      "metric_value": run.metric_value, "spot_check_bound": run.eval_bound,
                      "contamination": run.contamination}
    final_model_hash = bundle.end.final_model_hash.hex() if bundle is not None and bundle.end is not None else None
    # what the server decided about a run, and on what evidence
    predicate = dict(
        server={"public_key": lb.public_key, "software": f"witness {__version__}"},
        run={"id": run.id, "track": run.track, "task": track.task, "recipe": json.loads(track.config_json),
             "data_root": track.data_root, "trainer_key": acct.public_key, "trainer": acct.name, "r": run.r,
             "steps": run.steps, "final_size": run.final_size, "final_root": run.final_root,
             "final_state_hash": run.final_state_hash, "final_model_hash": final_model_hash,
             "submission_sha256": run.bundle_sha256},
        decision="certified" if run.status == "certified" else run.status, reason=run.reason,
        round=None if rnd is None else {"id": rnd.id, "kind": rnd.kind, "nonce": rnd.nonce, "count": rnd.count,
                                          "passed": rnd.passed, "bound": rnd.bound},
        challenges=challenges,
        bound={"bad_fraction": lb.settings.bad_fraction, "this_round": None if rnd is None else rnd.bound,
               "all_rounds": run.bound, "challenges_passed": run.challenges_passed},
        verdict=summary, evaluation=evaluation, decided_ms=run.decided_ms or 0)
    text = sign_decision(lb.key, subjects, predicate)
    run.statement = text
    append_decision(s, run, text)  # and an entry of the board's own history, which readers check
    if rnd is not None:
        rnd.statement = text
    return text
