"""A property over bundle shapes: from an honest online run and an honest offline run, leave out or
swap any subset of checkpoints, kept states, kept samples, chunk openings and statements (and
duplicate or reorder statements). Every audit is then unusable, rejected, or accepted with the bound
its own ledger gives, recomputed here from the ledger alone; no accepted audit counts a step without
a replay from a committed state whose hash was checked onto a compared one, nor claims a step's
move checked but in a window whose openings it read, the honest run's own."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import train_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_evidence import Served, train

from witness.bundle.layout import STATEMENTS, online_chunks_name
from witness.bundle.reader import open_bundle
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.record.online import OnlineSpec
from witness.verify import Policy, Trust, Verifier
from witness.verify.online import parse_statements

STEPS, F = 24, 0.05
SPEC = OnlineSpec(p=0.5, every=4, ring=9)
# derandomized: the same examples on every run (a failure here is a bug, never a flake)
SHAPES = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    beacon = Served(f"sqlite:///{d / 'beacon.db'}")
    try:
        train(d / "online", beacon.link(), steps=STEPS, spec=SPEC)  # p = 0.5: several selected steps a window
    finally:
        beacon.close()
    train_tiny(d / "offline", config={"steps": STEPS}, checkpoint_every=4)
    return {"online": d / "online", "offline": d / "offline", "beacon_key": beacon.public_key}


def _files(bundle: Path, folder: str) -> list[str]:
    return sorted(p.relative_to(bundle).as_posix() for p in (bundle / folder).glob("*")) \
        if (bundle / folder).exists() else []


@st.composite
def shapes(draw, bundle: Path):
    """What a trainer does to its bundle: files left out, files swapped, statements rewritten."""
    groups = {g: _files(bundle, g) for g in ("checkpoints", "online/states", "online/samples", "online/chunks")}
    drop, swaps = set(), []
    for names in groups.values():
        if names:
            drop |= draw(st.sets(st.sampled_from(names), max_size=len(names)))
            swaps += draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=2))
    lines = (bundle / STATEMENTS).read_bytes().splitlines() if (bundle / STATEMENTS).exists() else []
    order = draw(st.one_of(st.just(list(range(len(lines)))),
                           st.lists(st.sampled_from(range(len(lines))), max_size=len(lines) + 2))) if lines else []
    return drop, swaps, order


def _apply(bundle: Path, into: Path, shape) -> Path:
    drop, swaps, order = shape
    out = into / "b"
    shutil.copytree(bundle, out)
    for a, b in swaps:
        if a != b and (out / a).exists() and (out / b).exists():
            tmp = out / "swap.tmp"
            (out / a).rename(tmp)
            (out / b).rename(out / a)
            tmp.rename(out / b)
    for name in drop:
        (out / name).unlink(missing_ok=True)
    if (out / STATEMENTS).exists():
        lines = (out / STATEMENTS).read_bytes().splitlines()
        (out / STATEMENTS).write_bytes(b"".join(lines[i] + b"\n" for i in order))
    return out


def _judge(honest: Path, path: Path, trust: Trust | None = None, **policy) -> str:
    """unusable, rejected, or accepted with a bound recomputed here from the verdict's own ledger."""
    try:
        v = Verifier(trust, Policy(bad_fraction=F, **policy)).verify(path)
    except RunRejected as e:
        assert e.verdict is None or not e.verdict.accepted
        return "rejected"
    except MalformedInput:
        return "unusable"
    except VerificationError:
        return "rejected"
    assert v.accepted
    committed = open_bundle(honest)  # what the log commits (the honest bundle's: the log is untouched)
    n = len(committed.steps)
    done = set()
    for e in v.ledger:
        assert e.start <= e.step < e.end <= n
        assert committed.committed_state(e.start).hex() == e.start_hash  # a verified start
        assert committed.committed_state(e.end).hex() == e.end_hash
        done.add(e.step)
    if v.online is None:
        assert all(all(t in done for t in range(r.step, r.step + r.length)) for r in v.results)
        q = sum(1 for r in v.results if all(t in done for t in range(r.step, r.step + r.length)))
        want = 1.0 if done >= set(range(n)) else 1 - (1 - F) ** q
    else:
        o = v.online
        assert set(o["selected"]) <= done  # nothing skipped in a standalone audit
        if v.moves is not None:  # each window it counts was read, and was the honest run's own openings
            windows = {st.size: len(st.window(n)) for st in parse_statements(committed)}
            for size in v.moves["sizes"]:
                name = online_chunks_name(size)
                assert (path / name).read_bytes() == (honest / name).read_bytes()
            assert v.moves["checked"] + v.moves["late"] == sum(windows[size] for size in v.moves["sizes"])
            assert not v.moves["pending"] and v.moves["checked"] <= o["covered"]
        if o["attempts"] is None:
            want = 0.0
        else:
            unseen = o["unaudited"] + sum(1 for t in o["selected"] if t not in done)
            b = max(0, math.ceil(F * n - 1e-9) - unseen)
            want = (1 - (1 - o["p"]) ** b) ** (o["attempts"] + 1)
    assert v.detection_probability == pytest.approx(want, abs=1e-12)
    return "accepted"


@SHAPES
@given(data=st.data())
def test_an_online_run_in_any_shape_is_unusable_rejected_or_accepted_on_its_ledger(runs, data):
    honest = runs["online"]
    shape = data.draw(shapes(honest))
    nonce = data.draw(st.binary(min_size=1, max_size=4))
    with tempfile.TemporaryDirectory() as tmp:
        path = _apply(honest, Path(tmp), shape)
        outcomes = [_judge(honest, path, Trust(beacon_key=runs["beacon_key"]), mode="online"),
                    _judge(honest, path, challenges=8, nonce=nonce)]
    if shape == (set(), [], list(range(len(shape[2])))):
        assert outcomes == ["accepted", "accepted"]  # the honest run, as it is


@SHAPES
@given(data=st.data())
def test_an_offline_run_in_any_shape_is_unusable_rejected_or_accepted_on_its_ledger(runs, data):
    honest = runs["offline"]
    shape = data.draw(shapes(honest))
    nonce = data.draw(st.binary(min_size=1, max_size=4))
    q = data.draw(st.integers(1, STEPS + 2))
    with tempfile.TemporaryDirectory() as tmp:
        path = _apply(honest, Path(tmp), shape)
        outcome = _judge(honest, path, challenges=q, nonce=nonce)
    if not shape[0] and not [s for s in shape[1] if s[0] != s[1]]:
        assert outcome == "accepted"


def test_the_statements_bound_grows_with_a_witnessed_runs_heads_and_stops_at_a_gibibyte():
    """An honest long run with five ML-DSA-44 witnesses (about 17 KB a window line) keeps its windows under
    the bound its manifest sets; a manifest claiming absurd steps cannot make a verifier read more than 1 GiB."""
    from types import SimpleNamespace

    from witness.bundle.layout import MAX_STATEMENTS_BYTES
    from witness.bundle.reader import statements_bound

    def manifest(steps: int, every: int | None = 100):  # noqa: ANN202
        return SimpleNamespace(online={"every": every} if every else None, steps_planned=steps, checkpoint_every=1000)

    assert statements_bound(manifest(10_000)) == statements_bound(manifest(10_000, None)) == MAX_STATEMENTS_BYTES
    heads = 1_000_000 // 100 + 1_000_000 // 1000 + 2
    assert statements_bound(manifest(1_000_000)) >= heads * 17_000 > MAX_STATEMENTS_BYTES
    assert statements_bound(manifest(10**15)) == 1 << 30
