"""The online audit: the beacon's statements checked offline, then every step they selected replayed.

The verifier names the beacon key it trusts; a statement signed by any other key (a beacon the
trainer runs itself) proves nothing and is refused. Statements must chain (each one's window starts
where the one before it ended), so a trainer cannot keep the draws it liked and drop the others;
steps after the last statement are "not audited online" and the bound counts them as bad steps the
audit could not see.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..bundle.reader import Bundle
from ..commit.attempts import AttemptsNote, count_attempts
from ..commit.beacon import SEED_PRICED_VERSION, BeaconStatement, run_id, selected_steps
from ..commit.cosignature import verify_cosignature, verify_witness_note
from ..commit.drand import ChainInfo, round_time, verify_round
from ..commit.hashing import parse_canonical_json, same
from ..commit.note import Checkpoint, Note, NoteKey, parse_note, run_origin
from ..commit.signing import key_fingerprint, public_hex, public_key_from_hex
from ..commit.window import WitnessedWindow, head_sizes, parse_statement
from ..errors import MalformedInput, VerificationError
from .operator import OperatorChain, OperatorTrust


@dataclass(frozen=True)
class Draw:
    """One window's draw: the head size it closes at, the steps it covers, its beta, and whether it counts."""

    size: int
    steps: range
    beta: bytes
    counts: bool = True


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
    # witnessed windows: the windows whose cosignatures came too late for their round (their steps are
    # not audited online), and who was trusted for what
    late: list[range] = field(default_factory=list)
    witnessed: str | None = None  # "K of [names], drand chain X"; None: one beacon drew the randomness
    # the steps late windows' draws select: replayed too, though the bound does not count them (which
    # cosignatures a bundle shows is the trainer's choice: hiding an on-time one must not hide a draw)
    late_selected: list[int] = field(default_factory=list)
    # every window's draw, in order: the head size it closes at, its steps, its beta, and whether it
    # counts (a late window's draw is checked all the same, but claims nothing)
    draws: list[Draw] = field(default_factory=list)
    # the branches of one log its witnesses cannot tell apart: 1, unless the verifier requires K of N
    # witnesses with 2K <= N, when up to N // K disjoint sets of K could each cosign a branch of its own
    branches: int = 1
    # why a count the bundle holds cannot be used (``attempts`` is then None): an older rule counted it
    uncounted: str | None = None

    @property
    def priced(self) -> int | None:
        """The other attempts the bound is taken over: each attempt the count names may have up to
        ``branches`` branches (None: unknown, and the bound is 0)."""
        return None if self.attempts is None else (self.attempts + 1) * self.branches - 1

    @property
    def trust_warning(self) -> str | None:
        """A ``WARNING`` line where the verifier's witnesses cannot exclude a branched log."""
        if self.branches == 1:
            return None
        return (f"WARNING: weak witness quorum: {self.witnessed} lets {self.branches} disjoint sets of witnesses each "
                f"cosign a branch of this run's log without any witness seeing a fork, so the bound is taken over "
                f"{self.branches} branch(es) of every attempt; require more than half of the named witnesses "
                "(--witnesses-required) to exclude branches")

    @property
    def unseen(self) -> int:
        """Steps no draw could select: after the last window, and in windows cosigned too late."""
        return len(self.unaudited) + sum(len(r) for r in self.late)

    def describe(self) -> str:
        """One line for the verdict."""
        gap = f"; steps {self.unaudited.start}..{self.unaudited.stop - 1} not audited online" if self.unaudited else ""
        if self.late:
            gap += (f"; {len(self.late)} window(s) ({sum(len(r) for r in self.late)} step(s)) cosigned too close to "
                    "their drand round to count: not audited online")
        if self.witnessed is not None:
            if not self.windows:
                return f"no witnessed window: no step audited online{gap}"
            return (f"{self.windows} witnessed window(s) chain over steps 0..{self.covered - 1}, each cosigned by "
                    f"{self.witnessed} before its round; the randomness is drand's, so no single server drew it; "
                    f"selecting {len(self.selected)} step(s) at p = {self.p:g}{gap}")
        if not self.windows:
            return f"no beacon statement by {self.beacon}: no step audited online{gap}"
        return (f"{self.windows} beacon statement(s) by {self.beacon} chain over steps 0..{self.covered - 1}, "
                f"selecting {len(self.selected)} step(s) at p = {self.p:g}; the randomness is that beacon's own (the "
                f"verifier trusts it not to bias or leak it){gap}")

    def linking(self) -> str:
        """What the beacon saw of other attempts, and what that leaves unseen, for the verdict."""
        if self.attempts is None:
            why = self.uncounted or ("the bundle holds no final statement" if not self.final else
                                     "no named witness signed a count of them" if self.witnessed is not None else
                                     "its final statement is of version 1, which counts none")
            return (f"other attempts unknown: {why}, so the beacon's count of the trainer's other attempts (restarts "
                    "until a draw misses) is missing and the online bound is 0")
        who = "the witnesses linked" if self.witnessed is not None else "the beacon linked"
        branched = f" x {self.branches} branch(es) (a weak witness quorum)" if self.branches > 1 else ""
        return (f"{who} {self.others} other run(s) to this one (its key, recipe, run seed or account) and "
                f"prices {self.attempts} of them in as attempts at it (every run of its run seed): the bound is "
                f"taken over {self.attempts + 1} attempt(s){branched}; an attempt under another run seed is not "
                "seen (it trains from other weights on another data order: its trainer pays for its own training "
                "up to its bad steps)")


def parse_statements(bundle: Bundle) -> list[BeaconStatement]:
    """The bundle's statements, strictly parsed, as the trainer kept them (signatures not checked)."""
    out = []
    for i, line in enumerate(bundle.read_statements()):
        try:
            obj = parse_canonical_json(line)
        except ValueError as e:
            raise MalformedInput(f"online statement {i}: {e}") from None
        out.append(parse_statement(obj))
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
        if not isinstance(st, BeaconStatement):
            raise VerificationError(f"online statement {i} is a witnessed window, not a beacon's statement: verify it "
                                    "with --witness NAME=KEY and --drand", check="beacon")
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
    uncounted = None
    if last is not None and last.version == 2:  # counted before every run of a seed was priced
        last, uncounted = None, (f"its final statement is of version 2, whose beacon priced only the runs of the "
                                 f"same seed and recipe (a recipe field that changes no bit of the training escaped "
                                 f"it); version {SEED_PRICED_VERSION} prices every run of the seed")
    return OnlinePlan(key_fingerprint(public_hex(public)), p, m.online["every"], len(chain), selected,
                      covered, range(covered, n), final, last.others if last else None,
                      last.attempts if last else None, draws=[Draw(st.size, st.window(n), st.beta) for st in chain],
                      uncounted=uncounted)


@dataclass(frozen=True)
class WitnessTrust:
    """Whom the verifier trusts for witnessed windows: these witnesses' keys, how many of them must
    cosign each window, and the drand chain (pinned: its key, period and genesis)."""

    witnesses: tuple[NoteKey, ...]
    required: int
    chain: ChainInfo
    operator: OperatorTrust | None = None  # the windows came through this operator's log (its checkpoints cosigned)

    def __post_init__(self) -> None:
        if not self.witnesses:
            raise MalformedInput("witnessed online mode needs at least one --witness NAME=KEY")
        if len({k.public for k in self.witnesses}) != len(self.witnesses) \
                or len({k.name for k in self.witnesses}) != len(self.witnesses):
            raise MalformedInput("--witness: each witness is named once, with a key of its own (one key counted "
                                 "twice would pass for two witnesses)")
        if not 1 <= self.required <= len(self.witnesses):
            raise MalformedInput(f"--witnesses-required must be between 1 and the {len(self.witnesses)} witness(es) "
                                 "named")

    @property
    def branches(self) -> int:
        """How many branches of one log these witnesses could cosign, each through K of them, without any
        named witness seeing two: 1 where K > N/2 (any two sets of K share a witness, which refuses the
        second branch), else N // K disjoint sets."""
        return 1 if 2 * self.required > len(self.witnesses) else len(self.witnesses) // self.required

    def describe(self) -> str:
        """Who cosigns, for the verdict."""
        names = ", ".join(k.name for k in self.witnesses)
        through = f" through the operator log {self.operator.key.name}" if self.operator is not None else ""
        return (f"{self.required} of the witness(es) {names}{through} (drand chain "
                f"{self.chain.beacon_id or self.chain.hash.hex()[:16]})")


def check_online(bundle: Bundle, trust: str | WitnessTrust) -> OnlinePlan:
    """The online plan under the verifier's trust: one beacon's key (hex), or witnesses and drand."""
    return check_windows(bundle, trust) if isinstance(trust, WitnessTrust) else check_statements(bundle, trust)


def check_windows(bundle: Bundle, trust: WitnessTrust) -> OnlinePlan:
    """Every witnessed window: at a boundary the manifest sets, in an unbroken chain, its checkpoint
    this log's, cosigned by K of the named witnesses more than a drand period before the round its
    closing record names, and that round signed by the pinned drand chain."""
    m = bundle.manifest
    if m.online is None:
        raise MalformedInput("the run takes no online challenges (its manifest has no online settings)")
    run = run_id(bundle.log.lines[0])
    origin = run_origin(run)
    n, signed = len(bundle.steps), bundle.final_head.size
    boundaries = [s for s in head_sizes(m.online["every"], m.checkpoint_every, m.steps_planned, n, bundle.complete)
                  if s <= signed]
    windows: list[WitnessedWindow] = []
    for i, st in enumerate(parse_statements(bundle)):
        if not isinstance(st, WitnessedWindow):
            raise VerificationError(f"online statement {i} is a beacon's statement, not a witnessed window: the "
                                    "verifier named witnesses and drand (verify a beacon's with --beacon-key)",
                                    check="witness")
        windows.append(st)
    windows.sort(key=lambda w: w.size)
    for a, b in zip(windows, windows[1:], strict=False):
        if a.size == b.size:
            raise VerificationError(f"two witnessed windows close at the head of size {a.size}", check="witness")
    # through an operator's log: each window's operator checkpoint checked, in order (the verifier's trust decides)
    chain = OperatorChain(trust.operator, run, bytes.fromhex(m.public_key), _run_seed(bundle), bundle.log.extends,
                          signed) if trust.operator is not None else None
    selected: list[int] = []
    late: list[range] = []
    late_selected: list[int] = []
    draws: list[Draw] = []
    for i, w in enumerate(windows):
        if i >= len(boundaries) or w.size != boundaries[i]:
            where = "is not a boundary the manifest sets" if w.size not in boundaries else \
                f"follows the boundary at size {boundaries[i]}, which has no window: a window was withheld"
            raise VerificationError(f"the witnessed window closing at the head of size {w.size} {where}",
                                    check="witness")
        prev = boundaries[i - 1] if i else 0
        if w.prev_size != prev:
            raise VerificationError(f"the witnessed window closing at size {w.size} says it starts after size "
                                    f"{w.prev_size}, not after the boundary before it ({prev})", check="witness")
        on_time = _check_window(bundle, w, trust, origin, run, n, chain)
        draws.append(Draw(w.size, w.window(n), w.beta, on_time))
        if on_time:
            selected += selected_steps(w, m.online["p"], n)
        else:
            # with more witnesses named than required, a trainer that had one cosign late can show that
            # cosignature instead of an on-time one once it knows beta: the window's draw still stands
            late.append(w.window(n))
            late_selected += selected_steps(w, m.online["p"], n)
    covered = windows[-1].window(n).stop if windows else 0
    final = bool(windows) and windows[-1].size == signed and bundle.complete and windows[-1].final
    if windows and windows[-1].final and not final:
        raise VerificationError(f"the witnessed window closing at size {windows[-1].size} calls itself the run's final "
                                f"one, but the log is signed to size {signed}", check="witness")
    others = attempts = uncounted = None
    # through an operator's log, its entries are read whenever the verifier can: a second version of this
    # run's log entered beside this one is refused whether or not the run finished
    logged = chain.attempts() if chain is not None else None
    if final:
        others, attempts, uncounted = logged if logged is not None else _attempts(windows[-1], trust, origin, run)
    return OnlinePlan(trust.describe(), m.online["p"], m.online["every"], len(windows), sorted(selected), covered,
                      range(covered, n), final, others, attempts, late, trust.describe(), sorted(late_selected), draws,
                      trust.branches, uncounted)


def _check_window(bundle: Bundle, w: WitnessedWindow, trust: WitnessTrust, origin: str, run: bytes, n: int,
                  chain: OperatorChain | None = None) -> bool:
    """One window's checkpoint, round and cosignatures (of the operator's checkpoint that holds it, through
    ``chain``); whether K cosignatures came in time to count."""
    where = f"the witnessed window closing at size {w.size}"
    if not same(w.run, run):
        raise VerificationError(f"{where} names another run (a window replayed from another run)", check="witness")
    try:
        note = parse_note(w.checkpoint)
        cp = Checkpoint.parse(note.text)
    except (MalformedInput, ValueError) as e:
        raise MalformedInput(f"{where}: its checkpoint note: {e}") from None
    if cp.origin != origin or cp.size != w.size or cp.extensions:
        raise VerificationError(f"{where}: its checkpoint is not this run's head of that size (origin {cp.origin[:80]!r}, "
                                f"size {cp.size}{', with extension lines' if cp.extensions else ''})", check="witness")
    if not bundle.log.extends(cp.size, cp.root):
        raise VerificationError(f"{where}: its checkpoint's root is not this log's at size {cp.size}", check="witness")
    closing = bundle.steps[w.size - 2].round if w.size - 2 < n else bundle.end.round if bundle.end else None
    if closing != w.round:
        raise VerificationError(f"{where}: the log's record that closes it names drand round {closing}, the window "
                                f"round {w.round}", check="witness")
    verify_round(trust.chain, w.round, w.drand_signature)  # raises, naming the round and the chain
    if chain is not None:
        note = chain.window(w, where)
    elif w.operator is not None:
        raise VerificationError(f"{where} came through an operator's log, and the verifier pins none (--operator)",
                                check="witness")
    due = round_time(trust.chain, w.round)
    times = earliest_cosignatures(note, trust.witnesses)
    if len(times) < trust.required:
        raise VerificationError(f"{where} is cosigned by {len(times)} of the {trust.required} named witness(es) the "
                                "verifier requires", check="witness")
    return sum(t + trust.chain.period < due for t in times.values()) >= trust.required


def earliest_cosignatures(note: Note, keys: Iterable[NoteKey]) -> dict[str, int]:
    """Each key's earliest cosignature time on ``note``, by its name (a key with none is left out): the witness
    held the checkpoint then, whatever it signed again later. A line of one of ``keys`` that does not verify
    raises."""
    out = {}
    for key in keys:
        times = [verify_cosignature(note.text, sig, key) for sig in note.of_key(key)]
        if times:
            out[key.name] = min(times)
    return out


def _attempts(w: WitnessedWindow, trust: WitnessTrust, origin: str,
              run: bytes) -> tuple[int | None, int | None, str | None]:
    """The run's other attempts that the named witnesses signed counts of, for its final checkpoint:
    each priced run once, whichever witness saw it (the union of the runs the notes name).

    Every named witness that cosigned the final checkpoint must have signed a count: with K > N/2 any
    attempt that drew a window was cosigned by K named witnesses, one of which cosigned this run's final
    checkpoint too and so counted it. A missing count of such a witness is a rejection, never 0. With
    2K <= N an attempt may pass only through witnesses that never cosigned this run, so every named
    witness's count is needed; without one the attempts are unknown (None) and the bound is 0. So are
    they where a count is a version 1 note, made under the rule that priced only the runs of the same
    seed and recipe (with why, third)."""
    final = parse_note(w.checkpoint)
    cosigners = {key.name for key in trust.witnesses if final.of_key(key)}
    counted: dict[str, AttemptsNote] = {}
    for raw in w.attempts:
        try:
            note = parse_note(raw)
        except (MalformedInput, ValueError):
            raise MalformedInput("the final witnessed window holds an attempts note that does not parse") from None
        for key in trust.witnesses:
            if not verify_witness_note(note, key):
                continue
            try:
                found = AttemptsNote.parse(note.text)
            except MalformedInput as e:
                raise VerificationError(f"witness {key.name}'s attempts note: {e}", check="witness") from None
            # a witness that cosigned the final checkpoint counted as of it; one that did not (a weak quorum's
            # other witnesses) may have stopped earlier, but never holds this origin past the log's end
            if found.origin != origin or (found.size != w.size if key.name in cosigners else found.size > w.size):
                raise VerificationError(f"witness {key.name}'s attempts note is not a count for this run's final "
                                        f"checkpoint (it names {found.origin[:80]!r} at size {found.size}: a witness "
                                        "that holds another branch of this log, or another log's count)",
                                        check="witness")
            counted[key.name] = found
    missing = sorted(cosigners - set(counted))
    if missing:
        raise VerificationError(f"the final witnessed window is cosigned by {', '.join(missing)}, whose count of the "
                                "run's other attempts the bundle does not hold: every cosigning witness's count is "
                                "needed (a missing count is not a count of 0)", check="witness")
    if not counted:
        return None, None, None
    if trust.branches > 1 and len(counted) < len(trust.witnesses):
        lacking = ", ".join(sorted(k.name for k in trust.witnesses if k.name not in counted))
        return None, None, (f"a weak witness quorum needs every named witness's count (an attempt may have passed "
                            f"only through witnesses that never cosigned this run), and the bundle lacks {lacking}'s")
    old = sorted(name for name, n in counted.items() if n.version == 1)
    if old:
        return None, None, (f"the count of witness(es) {', '.join(old)} is a version 1 note, made under the rule that "
                            "priced only the runs of the same seed and recipe (a recipe field that changes no bit of "
                            "the training escaped it)")
    notes = list(counted.values())
    return max(n.others for n in notes), count_attempts(notes, run.hex()), None


def _run_seed(bundle: Bundle) -> bytes:
    """The run's seed, as its manifest commits it (what its operator-log registration is tagged with)."""
    seed = parse_canonical_json(bundle.log.lines[0]).get("run_seed")
    try:
        return bytes.fromhex(seed) if isinstance(seed, str) and len(seed) == 64 else b""
    except ValueError:
        return b""
