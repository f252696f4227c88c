"""The online audit: the beacon's statements checked offline, then every step they selected replayed.

The verifier names the beacon key it trusts; a statement signed by any other key (a beacon the
trainer runs itself) proves nothing and is refused. Statements must chain (each one's window starts
where the one before it ended), so a trainer cannot keep the draws it liked and drop the others;
steps after the last statement are "not audited online" and the bound counts them as bad steps the
audit could not see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..bundle.checkpoint import read_checkpoint
from ..bundle.reader import Bundle
from ..commit.beacon import BeaconStatement, run_id, selected_steps
from ..commit.hashing import parse_canonical_json, same
from ..commit.signing import key_fingerprint, public_hex, public_key_from_hex
from ..data.leaves import DatasetLeaves
from ..errors import MalformedInput, VerificationError
from .response import MAX_SAMPLE_BYTES, ResponseSamples, ResponseStep

MAX_SAMPLES_JSON = 64 * 1024 * 1024


@dataclass
class OnlinePlan:
    """What the statements decided: the windows, p, the selected steps and what no statement covers."""

    beacon: str  # fingerprint of the key the verifier named
    p: float
    every: int
    windows: int
    selected: list[int]
    covered: int  # steps 0 .. covered - 1 lie in a statement's window
    unaudited: range
    final: bool  # the run's final head has a statement
    # the final statement's count of other runs the beacon linked to this one (key, recipe, run seed
    # or account), and of the attempts among them it prices in; None where no final statement counts
    others: int | None = None
    attempts: int | None = None

    def describe(self) -> str:
        """One line for the verdict."""
        gap = f"; steps {self.unaudited.start}..{self.unaudited.stop - 1} not audited online" if self.unaudited else ""
        if not self.windows:
            return f"no beacon statement by {self.beacon}: no step audited online{gap}"
        return (f"{self.windows} beacon statement(s) by {self.beacon} chain over steps 0..{self.covered - 1}, "
                f"selecting {len(self.selected)} step(s) at p = {self.p:g}{gap}")

    def linking(self) -> str:
        """What the beacon saw of other attempts, and what that leaves unseen, for the verdict."""
        if self.attempts is None:
            why = "the bundle holds no final statement" if not self.final else \
                "its final statement is of version 1, which counts none"
            return (f"other attempts unknown: {why}, so the beacon's count of the trainer's other attempts (restarts "
                    "until a draw misses) is missing and the online bound is 0")
        return (f"the beacon linked {self.others} other run(s) to this one (its key, recipe, run seed or account) and "
                f"prices {self.attempts} of them in as attempts at it: the bound is taken over {self.attempts + 1} "
                "attempt(s); an attempt under a fresh key with another run seed is not seen (it costs its trainer "
                "its own training up to its bad steps)")


def parse_statements(bundle: Bundle) -> list[BeaconStatement]:
    """The bundle's statements, strictly parsed, as the trainer kept them (signatures not checked)."""
    out = []
    for i, line in enumerate(bundle.read_statements()):
        try:
            obj = parse_canonical_json(line)
        except ValueError as e:
            raise MalformedInput(f"online statement {i}: {e}") from None
        out.append(BeaconStatement.from_json(obj))
    return out


def selected_by(statements: list[BeaconStatement], p: float, steps: int) -> list[int]:
    """Every step the statements select, ascending."""
    return sorted(t for st in statements for t in selected_steps(st, p, steps))


def check_statements(bundle: Bundle, beacon_key: str) -> OnlinePlan:
    """Every statement: the named beacon's signature, this run, a head of this log, an unbroken chain."""
    m = bundle.manifest
    if m.online is None:
        raise MalformedInput("the run takes no online challenges (its manifest has no online settings)")
    try:
        public = public_key_from_hex(beacon_key)
    except (MalformedInput, ValueError) as e:
        raise MalformedInput(f"--beacon-key: {e}") from None
    run = run_id(bundle.log.lines[0])
    signed = bundle.final_head.size
    statements: dict[int, BeaconStatement] = {}
    windows: dict[int, int] = {}  # prev_size -> size: the window each statement opens
    for i, st in enumerate(parse_statements(bundle)):
        st.verify(public)
        if not same(st.run, run):
            raise VerificationError(f"beacon statement {i} answers another run's head (a statement replayed from "
                                    "another run)", check="beacon")
        if st.size > signed or not bundle.log.extends(st.size, st.root):
            raise VerificationError(f"beacon statement {i} stamps a head of size {st.size} that is not this log's",
                                    check="beacon")
        if st.size in statements:
            raise VerificationError(f"two beacon statements stamp the head of size {st.size}", check="beacon")
        if st.prev_size in windows:
            # one window drawn twice: the trainer could keep the draw it liked (a beacon's race)
            raise VerificationError(f"two beacon statements open a window after the head of size {st.prev_size} "
                                    f"(for heads of size {windows[st.prev_size]} and {st.size}): one window has "
                                    "one draw", check="beacon")
        if st.final and st.size != signed:
            raise VerificationError(f"beacon statement {i} calls the head of size {st.size} the run's final one, "
                                    f"but the log is signed to size {signed}", check="beacon")
        statements[st.size] = st
        windows[st.prev_size] = st.size
    prev = 0
    chain = [statements[k] for k in sorted(statements)]
    for st in chain:
        if st.prev_size != prev:
            raise VerificationError(f"the beacon's statement for the head of size {st.size} follows its statement for "
                                    f"size {st.prev_size}, which the bundle {'lacks' if st.prev_size > prev else 'contradicts'}"
                                    ": a statement was withheld", check="beacon")
        prev = st.size
    n = len(bundle.steps)
    p = m.online["p"]
    covered = chain[-1].window(n).stop if chain else 0
    selected = selected_by(chain, p, n)
    final = bool(chain) and chain[-1].size == signed and bundle.complete and chain[-1].final
    last = chain[-1] if final else None
    return OnlinePlan(key_fingerprint(public_hex(public)), p, m.online["every"], len(chain), selected,
                      covered, range(covered, n), final, last.others if last else None,
                      last.attempts if last else None)


class OnlineStates:
    """The states a trainer kept for its selected steps (and the checkpoints, where one falls there)."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The supplied state after ``step`` updates."""
        path = self.bundle.online_states.get(step) or self.bundle.checkpoints.get(step)
        if path is None:
            raise VerificationError(f"the trainer kept no state after {step} update(s), which a selected step "
                                    "starts or ends at", step=step, check="online")
        return read_checkpoint(path)


class OnlineSamples:
    """The samples a trainer kept for its selected steps, each checked against the dataset's leaves."""

    def __init__(self, bundle: Bundle, leaves: DatasetLeaves, rule: str):
        self.bundle = bundle
        self.steps: dict[int, ResponseStep] = {}
        self._check = ResponseSamples(self, bundle.manifest.data_root, bundle.manifest.dataset_size,  # type: ignore[arg-type]
                                      bundle.end, leaves, rule)

    def samples(self, step: int, indices: Sequence[int], root: bytes) -> list[bytes]:
        """The batch of ``step`` from its samples file, every sample its committed leaf's."""
        path = self.bundle.online_samples.get(step)
        if path is None:
            raise VerificationError("the trainer kept no samples for this selected step", step=step, check="online")
        if path.stat().st_size > MAX_SAMPLES_JSON:
            raise MalformedInput(f"{path.name} is over {MAX_SAMPLES_JSON} bytes")
        try:
            obj = parse_canonical_json(path.read_bytes())
        except ValueError as e:
            raise MalformedInput(f"{path.name}: {e}") from None
        if not isinstance(obj, dict) or set(obj) != {"step", "indices", "samples"} or obj["step"] != step \
                or not isinstance(obj["indices"], list) or not isinstance(obj["samples"], list):
            raise MalformedInput(f"{path.name}: not the samples of step {step}")
        try:
            samples = [bytes.fromhex(s) for s in obj["samples"]]
        except (ValueError, TypeError) as e:
            raise MalformedInput(f"{path.name}: {e}") from None
        if any(len(s) > MAX_SAMPLE_BYTES for s in samples) or not all(type(i) is int for i in obj["indices"]):
            raise MalformedInput(f"{path.name}: bad indices or an oversized sample")
        self.steps[step] = ResponseStep(obj["indices"], samples, [[] for _ in samples], None)
        return self._check.samples(step, indices, root)
