"""Contest tracks on the server: methods submitted as wheels, admitted against the track's budget in the
sandbox, pinned by the tickets of their runs, and certified by replay in the sandbox with their evaluation
scored blind (``witness.methods.contest``).

A method is an account's wheel on one track. Its code runs only in the sandbox, on the server (its
admission: ``methods.contest.admit``) and on the workers (replay and scoring). The ticket of every run of
it names it, so the run's manifest must pin exactly that wheel's files from its first streamed head on: a
method changed after its ticket is refused there, and at submission.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..commit.hashing import canonical_json
from ..errors import MalformedInput, VerificationError
from ..methods.contest import Budget, admit
from ..methods.process import NoSandbox
from ..methods.wheel import MAX_WHEEL_BYTES, MethodWheel, read_wheel
from ..task.registry import build_task
from .common import ApiError, _lock_writes
from .db import Account, Admission, Method, Run, Track, now_ms

METHODS_PER_HOUR = 10  # admissions an account may ask for an hour, refused ones too: each runs the method in the sandbox
NAME_MAX = 100


def method_key(wheel_sha256: str) -> str:
    """Where the store keeps a method's wheel."""
    return f"methods/{wheel_sha256}.whl"


def budget_of(track: Track) -> Budget | None:
    """A contest track's budget (None: a track of one recipe)."""
    return None if track.contest_json is None else Budget.from_json(json.loads(track.contest_json))


def data_task(track: Track) -> Any:  # noqa: ANN401 - a Task
    """The registered task whose data, evaluation split and scoring a contest track fixes."""
    return build_task(track.task, json.loads(track.config_json))


def method_json(m: Method, account: str | None = None) -> dict:
    """A method as the API shows it."""
    return {"id": m.id, "track": m.track, "name": m.name, "account": account, "task": m.task,
            "distribution": m.distribution, "version": m.version, "wheel_sha256": m.wheel_sha256,
            "task_source": {"distribution": m.distribution, "version": m.version, "files_sha256": m.files_sha256},
            "recipe": json.loads(m.config_json), "steps": m.steps, "batch_size": m.batch_size, "params": m.params,
            "created_ms": m.created_ms, "wheel": f"/methods/{m.id}/wheel"}


class ContestRuns:
    """The leaderboard's part that takes methods (mixed into ``Leaderboard``)."""

    def register_method(self, s: Session, acct: Account, track_name: str, data: bytes,
                        name: str | None = None, task: str | None = None) -> tuple[Method, bool]:
        """Admit a method (a wheel) to a contest track: read strictly, described in the sandbox, held to the
        budget, kept in the store. (The method, whether it is new); an ``ApiError`` saying why not."""
        track = self.track(s, track_name)  # type: ignore[attr-defined]
        budget = budget_of(track)
        if budget is None:
            raise ApiError(400, f"track {track.name!r} has one recipe: its runs bring no method")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= NAME_MAX or "\0" in name):
            raise ApiError(400, f"a method's name is 1 to {NAME_MAX} characters")
        try:
            wheel = read_wheel(data)
        except MalformedInput as e:
            raise ApiError(400, f"the wheel: {e}") from None
        if len(wheel.distribution) > NAME_MAX or len(wheel.version) > 64:  # kept whole: the pin names them
            raise ApiError(400, f"a method's distribution name is at most {NAME_MAX} characters and its version 64")
        old = s.scalar(select(Method).where(Method.account_id == acct.id, Method.track == track.name,
                                            Method.files_sha256 == wheel.files_sha256))
        if old is not None:
            return old, False
        # every admission runs the method in the sandbox, refused or not: each counts, under a lock on the
        # account's row (PostgreSQL; SQLite's write lock), so a parallel burst gets exactly the limit
        if s.get_bind().dialect.name == "postgresql":
            s.execute(select(Account.id).where(Account.id == acct.id).with_for_update())
        else:
            _lock_writes(s)
        hour_ago = now_ms() - 3_600_000
        if (s.scalar(select(func.count()).select_from(Admission).where(
                Admission.account_id == acct.id, Admission.made_ms > hour_ago)) or 0) >= METHODS_PER_HOUR:
            raise ApiError(429, f"at most {METHODS_PER_HOUR} method admissions an hour per account")
        s.add(Admission(account_id=acct.id, made_ms=now_ms()))
        s.commit()
        try:
            a = admit(wheel, budget, data_task(track), task)
        except NoSandbox as e:  # the server's problem, never the method's
            raise ApiError(503, f"this server cannot run the sandbox now: {e}") from None
        except (MalformedInput, VerificationError) as e:  # (MethodFailed: the method failed to describe itself)
            raise ApiError(400, f"method refused: {e}") from None
        digest = hashlib.sha256(data).hexdigest()
        path = self.store.scratch("method.whl")  # type: ignore[attr-defined]
        path.write_bytes(data)
        self.store.put(method_key(digest), path)  # type: ignore[attr-defined]
        m = Method(account_id=acct.id, track=track.name, name=name or f"{wheel.distribution} {wheel.version}",
                   wheel_sha256=digest, files_sha256=wheel.files_sha256, distribution=wheel.distribution,
                   version=wheel.version, task=a.task, config_json=canonical_json(a.config).decode(),
                   steps=a.steps, batch_size=a.batch_size, params=a.params, created_ms=now_ms())
        s.add(m)
        try:
            s.commit()
        except IntegrityError:  # the same files admitted a moment ago by a parallel request
            s.rollback()
            return s.scalars(select(Method).where(Method.account_id == acct.id, Method.track == track.name,
                                                  Method.files_sha256 == wheel.files_sha256)).one(), False
        return m, True

    def method(self, s: Session, method_id: int) -> Method:
        """A method, or 404."""
        m = s.get(Method, method_id) if type(method_id) is int and 0 < method_id < 2**31 else None
        if m is None:
            raise ApiError(404, f"no method {method_id}")
        return m

    def ticket_method(self, s: Session, acct: Account, track: Track, method_id: int | None) -> int | None:
        """The method a new ticket names: one of the account's on a contest track, none on another."""
        if track.contest_json is None:
            if method_id is not None:
                raise ApiError(400, f"track {track.name!r} has one recipe: its runs bring no method")
            return None
        if method_id is None:
            raise ApiError(400, f"track {track.name!r} is a contest: a ticket names one of your methods "
                                "(POST /api/tracks/NAME/methods first)")
        m = self.method(s, method_id)
        if m.account_id != acct.id or m.track != track.name:
            raise ApiError(403, f"method {method_id} is not one of your methods on track {track.name!r}")
        return m.id

    def check_method_manifest(self, s: Session, run: Run, m: dict) -> None:
        """A contest run's manifest: the method its ticket named, exactly (its pin, task and recipe)."""
        method = s.get(Method, run.method_id)
        source = {"distribution": method.distribution, "version": method.version, "files_sha256": method.files_sha256}
        if m.get("task_source") != source:
            raise ApiError(400, f"the run was not trained with method {method.id} ({method.distribution} "
                                f"{method.version}, files {method.files_sha256[:16]}…) that its ticket names: a "
                                "method changed after its ticket is not the one admitted")
        if m.get("task") != method.task or canonical_json(m.get("task_config")).decode() != method.config_json:
            raise ApiError(400, f"the run's recipe is not method {method.id}'s ({method.task} {method.config_json})")

    def method_wheel(self, method: Method) -> MethodWheel:
        """A method's wheel from the store, read strictly again and checked against its hash."""
        path = self.store.fetch(method_key(method.wheel_sha256), self.store.scratch("method.whl"))  # type: ignore[attr-defined]
        try:
            data = path.read_bytes()[: MAX_WHEEL_BYTES + 1]
        finally:
            path.unlink(missing_ok=True)
        if hashlib.sha256(data).hexdigest() != method.wheel_sha256:
            raise RuntimeError(f"the store's copy of method {method.id}'s wheel is not the one admitted")
        return read_wheel(data)


def contest_trust(lb, s: Session, run: Run, track: Track) -> dict:  # noqa: ANN001 - the Leaderboard
    """What a contest run is verified under, besides what every run is: its method (replayed only in the
    sandbox) and the track's data (the verifier's own, never the method's); {} for a track of one recipe."""
    if run.method_id is None:
        return {}
    return {"method": lb.method_wheel(s.get(Method, run.method_id)), "dataset": data_task(track).dataset()}


def score_contest(lb, s: Session, run: Run, track: Track, bundle, threads: int = 1) -> tuple[dict, int, list, str, Path]:  # noqa: ANN001
    """A verified contest run held to the budget, its evaluation documents proven absent from its training
    data, and its released model scored blind in the sandbox; the signed certificate (the server its
    evaluator) is written for the run's evaluation. (Aggregates, evaluation documents, the model's tied names as
    the method describes them, the budget's line for the verdict, the certificate's file); ``VerificationError``
    saying what fails."""
    from ..evals.certificate import build_body, sign_certificate
    from ..methods.contest import check_budget, contamination, score_blind
    from ..methods.process import MethodFailed, MethodSandbox
    from ..methods.remote import RemoteTask

    method, task = s.get(Method, run.method_id), data_task(track)
    within = check_budget(bundle, budget_of(track), task)
    absences, near = contamination(bundle, task)
    with MethodSandbox(lb.method_wheel(method), method.task, threads) as box:
        remote = RemoteTask(box, bundle.manifest.task_config)
        if any(not n.startswith("model.") for g in remote.aliases for n in g):  # (names of its model's state only)
            raise MethodFailed("the method describes tied weights that are not its model's", check="method")
        examples, aggregates = score_blind(box, remote, bundle, task)
    ev = task.eval_dataset()
    body = build_body(method.task, bundle.final_head, bundle.manifest.public_key, (ev.root, len(ev)), examples,
                      aggregates, absences, near)
    # kept by the worker only with the decision that certifies the run: a signed score of an undecided run is
    # never served
    path = lb.store.scratch("evaluation.json")
    path.write_bytes(canonical_json(sign_certificate(body, lb.key)) + b"\n")
    return aggregates, len(absences), remote.aliases, within, path
