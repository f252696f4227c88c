"""The verdict of an audit: what was checked, every distance against its threshold, and the bound."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .challenges import WEAK_BOUND, percent_down, weak_bound_warning
from .ledger import LedgerEntry


@dataclass
class ChallengeResult:
    """Outcome of one replay challenge."""

    step: int
    length: int
    passed: bool
    replayed_steps: int
    distances: dict[str, float] = field(default_factory=dict)
    failure: str | None = None


@dataclass
class Verdict:
    """Accepted or rejected, and why."""

    accepted: bool
    mode: str
    exact: bool
    task: str
    steps: int
    complete: bool
    signer: str
    challenges: int
    bad_fraction: float
    detection_probability: float
    nonce: str
    state_every: int = 1
    threads: int = 1
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)
    results: list[ChallengeResult] = field(default_factory=list)
    replayed_steps: int = 0  # step replays run (a step replayed again, after a failed segment, counts again)
    distinct_steps: int | None = None  # the steps replayed, each once
    verify_seconds: float = 0.0
    replay_flops: float = 0.0
    training_flops: float = 0.0
    confidence: float | None = None  # the bound the user asked for, if any
    online: dict | None = None  # the online audit: beacon, p, windows, selected steps, what no statement covers
    # the bounded-move audit of a chunked online run: chunks opened per step, steps checked, the worst move
    moves: dict | None = None
    # the evidence the bound is computed from: every step replayed, from and to which committed states
    ledger: list[LedgerEntry] = field(default_factory=list)
    verified: int = 0  # challenges (or, online, selected steps) the ledger holds every step of
    # the data root, and what it was checked against (None: taken on the trainer's word)
    data_root: str = ""
    data_checked: str | None = None

    @property
    def floor(self) -> float:
        """The bound this verdict must reach to pass: the confidence asked for, else 90 %."""
        return WEAK_BOUND if self.confidence is None else self.confidence

    @property
    def outcome(self) -> str:
        """``accepted`` (and the bound reaches the floor), ``weak`` (accepted below it) or ``rejected``."""
        if not self.accepted:
            return "rejected"
        return "accepted" if self.detection_probability >= self.floor else "weak"

    @property
    def warning(self) -> str | None:
        """The weak-audit warning, when the bound is below the confidence asked for (or 90 %)."""
        if self.online is None:
            return weak_bound_warning(self.detection_probability, self.bad_fraction, self.confidence)
        from ..commit.beacon import p_needed

        floor = self.floor
        if self.detection_probability >= floor:
            return None
        if self.online.get("attempts") is None:
            return (f"WARNING: weak audit: the online bound is 0, below the {100 * floor:g}% "
                    f"{'asked for' if self.confidence is not None else 'that a meaningful audit needs'}: "
                    + (self.online.get("uncounted") or (
                        "no named witness signed a count of the run's other attempts" if self.online.get("witnessed")
                        else "no final beacon statement counts the run's other attempts"))
                    + " (or add an after-the-fact audit)")
        need = p_needed(floor, self.bad_fraction, self.steps - self.online["unaudited"])
        return (f"WARNING: weak audit: the online bound {percent_down(self.detection_probability)}% is below the "
                f"{100 * floor:g}% {'asked for' if self.confidence is not None else 'that a meaningful audit needs'}: "
                f"the run's beacon selected steps with p = {self.online['p']:g}, and {100 * floor:g}% needs "
                f"p >= {need:.3g} with every step under a statement and no other attempt "
                "(or add an after-the-fact audit)")

    @property
    def cost_fraction(self) -> float:
        """Replay compute as a fraction of the training compute."""
        return self.replay_flops / self.training_flops if self.training_flops else 0.0

    def _formula(self) -> str:
        if self.online is not None:
            k = self.online.get("priced", self.online.get("attempts"))
            if k is None:
                return "0: other attempts unknown"
            one = "1-(1-p)^ceil(fT)" + (" less the steps not audited" if self.online["unaudited"] else "")
            return f"({one})^{k + 1} over {k + 1} attempts" if k else one
        if self.steps and {e.step for e in self.ledger} >= set(range(self.steps)):
            return "every step replayed"
        return f"1-(1-f)^q, q = {self.verified} challenge(s) the ledger verifies"

    def to_json(self) -> dict:
        """The ``--json`` form: the verdict (accepted, weak or rejected) and the bound beside everything."""
        out = asdict(self)
        out["cost_fraction"] = self.cost_fraction
        out["warning"] = self.warning
        out["verdict"] = self.outcome
        out["bound"] = self.detection_probability
        return out

    def _replayed(self) -> str:
        distinct = self.replayed_steps if self.distinct_steps is None else self.distinct_steps
        if distinct == self.replayed_steps:
            return f"{distinct} step(s) replayed"
        # a failed segment is replayed again by each later challenge in it: compute, not more evidence
        return f"{distinct} distinct step(s) replayed ({self.replayed_steps} replays of them)"

    def summary(self) -> str:
        """A few readable lines."""
        head = {"accepted": "ACCEPTED", "weak": "ACCEPTED (WEAK)", "rejected": "REJECTED"}[self.outcome]
        lines = [
            f"{head}: {self.task} run of {self.steps} steps ({'complete' if self.complete else 'incomplete'}), signed by {self.signer}",
            f"  mode {self.mode}, {'exact' if self.exact else 'tolerance'} comparison, {self.challenges} challenge(s), "
            f"{self._replayed()} = {100 * self.cost_fraction:.2f}% of the training compute"
            f" ({self.threads} thread(s))",
            "  each challenge replays from the committed training state before its step to the one after it "
            + ("(the whole state is committed at every step)" if self.state_every == 1 else
               f"(the whole state is committed every {self.state_every} steps)"),
            f"  bound: had >= {100 * self.bad_fraction:g}% of the steps been bad, this audit would have caught it "
            f"with probability >= {percent_down(self.detection_probability)}% "
            f"({self._formula()})",
        ]
        earlier = sum(1 for e in self.ledger if e.earlier)
        lines.insert(2, f"  evidence: {len(self.ledger)} step(s) replayed from a committed state whose hash was checked "
                        "onto a committed state that was compared" + (f" ({earlier} by an earlier audit)" if earlier
                                                                         else ""))
        if self.online is not None:
            o = self.online
            if o.get("witnessed"):  # drand's randomness, each window cosigned by K named witnesses
                who = (f"witnessed windows, cosigned by {o['witnessed']} before their rounds (randomness: drand), "
                       f"{o['windows']} window(s)")
            else:
                who = (f"beacon {o['beacon']} (its own randomness, trusted not to bias or leak it), {o['windows']} "
                       "statement(s)")
            lines.insert(2, f"  online: {who}, p = {o['p']:g}, selected steps {_steps(o['selected'])}"
                            + (f"; {o['unaudited']} step(s) not audited online (after the last window, or in windows "
                               "cosigned too late)" if o["unaudited"] else ""))
            lines.insert(3, f"  attempts: {o['linking']}")
            if o.get("trust_warning"):
                lines.insert(1, f"  {o['trust_warning']}")
            if self.moves is not None:
                lines.insert(4, f"  {self.moves['summary']}")
        if self.data_root:
            lines.append(f"  data root {self.data_root[:16]}…: " + (f"checked against {self.data_checked}"
                         if self.data_checked else "taken on the trainer's word (not compared with any data this "
                         "verifier holds: pass --data-root HEX, or audit offline with the data)"))
        if self.warning:
            lines.insert(1, f"  {self.warning}")
        if self.thresholds:
            worst: dict[str, float] = {}
            for r in self.results:
                for k, v in r.distances.items():
                    k = "optimizer" if k.startswith("optimizer.") else k  # one threshold for every optimizer key
                    worst[k] = max(worst.get(k, 0.0), v)
            for k, thr in self.thresholds.items():
                lines.append(f"  {k}: max distance {worst.get(k, 0.0):.3g} against threshold {thr:.3g}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  FAILED: {f}" for f in self.failures]
        return "\n".join(lines)


def _steps(steps: list[int], most: int = 12) -> str:
    """A list of steps, cut short when long."""
    shown = ", ".join(map(str, steps[:most]))
    return (shown + f", … ({len(steps)} in all)") if len(steps) > most else (shown or "none")
