"""Every step checked: the parameter chunks each window's beta opened, their paths to the records'
roots, and how far every opened coordinate moved in every step of the window.

A chunked online run commits, in each step's record, the root of its parameters' chunk tree; each
window's beta (drawn after the window's records were signed) opens ``k`` chunks of every state the
window's steps go from and to. Here the openings of all windows are read, their paths checked level
by level against the records' roots (the initial state's root is computed from the state the seed
gives), and each opened coordinate's move is held to the optimizer's bound, ``lr_t * B_t`` after the
decoupled weight decay (``witness.fingerprint.moves``). The bound, the layout and the rules come from
the task's own model and optimizer, never from the bundle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..bundle.opened import ModelLeaves
from ..bundle.openings import read_openings
from ..bundle.reader import Bundle
from ..bundle.state import state_hash
from ..commit.chunks import path_nodes
from ..commit.hashing import same
from ..errors import MalformedInput, VerificationError
from ..fingerprint.chunks import ChunkLayout
from ..fingerprint.moves import (
    MoveRules,
    move_limits,
    move_rules,
    skipped,
    step_offset,
    step_ranges,
    tensor_rms,
    unchanged,
)
from .online import OnlinePlan
from .paths import Batch, MoveFailure, check_padding, check_paths, check_tree_paths

_NUMPY = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
BATCH_BYTES = 64 << 20  # openings checked together: a run's windows are read and checked this much at a time


@dataclass
class MoveCheck:
    """What the bounded-move audit checked, for the verdict."""

    chunks: int  # opened of every state, per window
    of: int  # chunks in the layout
    chunk_bytes: int
    optimizer: str  # and its bounds, or why no bound holds (refused)
    refused: bool = False
    steps: int = 0  # the run's signed steps
    checked: int = 0  # steps whose move was checked in a window that counts
    late: int = 0  # steps checked in windows that count for nothing (their draw may have been known)
    pending: int = 0  # steps of windows whose openings have not arrived (a leaderboard's live audit)
    # the largest move as a fraction of what its step allowed, among those within a thousandth of their
    # bound (an honest run's first step moves every coordinate with a gradient by lr: B_1 = 1)
    worst: float = 0.0
    # the largest share of the rounding slack (the move allowed past lr * B: 2^-16 of it and 4 ulps) any
    # move used: how close an honest run's rounding comes to a false rejection (1 would be one)
    slack_used: float = 0.0
    windows: int = 0
    # what the check can discriminate: the smallest RMS of a parameter tensor (the larger of the initial
    # and the final state's) and that tensor, the largest allowance lr_t * B_t of any step and its step,
    # the steps (inclusive ranges) whose allowance reaches some tensor's RMS (there that whole tensor fits
    # in one step's move) and those tensors, and the spikes: steps allowed over SPIKE ordinary steps' move
    scale: float = 0.0
    scale_tensor: str = ""
    largest: float = 0.0
    largest_step: int = 0
    median: float = 0.0  # the run's median allowance: what an ordinary step may move a coordinate
    blind: list[list[int]] = field(default_factory=list)
    blind_tensors: list[str] = field(default_factory=list)
    spikes: list[list[int]] = field(default_factory=list)  # steps allowed over SPIKE ordinary steps' move
    missing: list[int] = field(default_factory=list)  # head sizes of the pending windows
    ignored: list[int] = field(default_factory=list)  # head sizes of openings no statement in the bundle opens
    sizes: list[int] = field(default_factory=list)  # head sizes of the windows checked
    seconds: float = 0.0  # what the check took
    # a layout over ranks: the chunks that hold parameter bytes (the others are each rank's zero padding,
    # which an opening checks to be zero but which holds no move); 0: every chunk holds bytes
    holding: int = 0

    def to_json(self) -> dict:
        """The verdict's ``moves`` field."""
        return dict(self.__dict__)

    def describe(self) -> str:
        """One line for the verdict."""
        if self.refused:
            return f"every step: bounded move not checked ({self.optimizer})"
        padded = f", drawn among the {self.holding} that hold parameters" if self.holding else ""
        out = (f"every step: bounded move checked at {self.chunks} chunk(s) of {self.of} ({self.chunk_bytes} bytes "
               f"each{padded}) per step, {self.checked} of the run's {self.steps} step(s) in {self.windows} window(s); "
               f"{self.optimizer}; the parameters' moves (buffers, such as BatchNorm's running statistics, are left "
               "to replay)")
        if self.steps and self.scale_tensor:
            out += (f"; the most a step may move a coordinate is lr x B = {self.largest:.3g} (step {self.largest_step}), "
                    f"{self.largest / self.scale:.3g} of the smallest RMS of a parameter tensor ({self.scale:.3g}, "
                    f"{self.scale_tensor})")
        if self.blind:
            out += (f"; WARNING: at step(s) {blind_text(self.blind)} a step may move a coordinate by the whole RMS "
                    f"of {', '.join(self.blind_tensors[:3])}{' and others' if len(self.blind_tensors) > 3 else ''} or "
                    "more: there the check cannot tell a swapped tensor from a step (only replay, at rate p, checks "
                    "those steps)")
        if self.spikes:
            out += (f"; WARNING: step(s) {blind_text(self.spikes)} may move a coordinate over {SPIKE:g} times as far as "
                    f"the run's median step ({self.median:.3g}): a model that far from the honest one (a fine-tune of "
                    "the same start, say) fits in one such step, and only replay, at rate p, checks those steps")
        if self.checked + self.late + self.pending < self.steps:
            out += (f"; {self.steps - self.checked - self.late - self.pending} step(s) in no window a statement here "
                    "opens: not checked")
        if self.late:
            out += f"; {self.late} more step(s) checked in windows that count for nothing (cosigned too late)"
        if self.pending:
            out += f"; {self.pending} step(s) wait for their window's openings"
        if self.ignored:
            out += f"; openings of {len(self.ignored)} window(s) no statement here opens were passed over"
        return out


def check_moves(bundle: Bundle, plan: OnlinePlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                init: dict[str, torch.Tensor], pending_allowed: bool = False) -> MoveCheck:
    """Check every window's openings and every opened coordinate's move; raise at the first that fails.

    ``model`` and ``optimizer`` are the task's, built here; ``init`` the initial state the seed gives
    (used only if it hashes to the manifest's). ``pending_allowed``: a window without openings is
    pending (a live audit), not a failure."""
    m = bundle.manifest
    assert m.online is not None and m.chunked
    k, cb = m.online["chunks"], m.online["chunk_bytes"]
    layout = ChunkLayout.of_model(model, cb, m.state_shards)  # over W ranks: each rank's rows a subtree
    rules = move_rules(model, optimizer)
    if isinstance(rules, str):
        return MoveCheck(k, layout.size, cb, rules, refused=True)
    n, offset = len(bundle.steps), step_offset(init)
    out = MoveCheck(min(k, len(layout.holding)), layout.size, cb, rules.describe(n, offset), steps=n)
    if layout.shards > 1:  # each rank's chunks padded to a power of two: only those that hold bytes are drawn
        out.holding = len(layout.holding)
    init = _initial(bundle, init)
    if m.tree:  # version 4: each chunk opens into its state's hash, a tree of the record's state_leaves
        leaves = ModelLeaves(model, layout)
        hashes = [m.init_state_hash] + [r.state_hash for r in bundle.steps]
        sizes = [len(init)] + [r.state_leaves for r in bundle.steps]

        def lengths(t: int, ids: np.ndarray) -> np.ndarray:
            return leaves.lengths(ids, np.full(len(ids), sizes[t] or 0))
    else:  # version 3: into the param_root of its chunk tree (the initial one computed here)
        roots = _roots(bundle, layout, init)

        def lengths(t: int, ids: np.ndarray) -> np.ndarray:
            return np.array([len(path_nodes(int(c), layout.size)) for c in ids], dtype=np.int64)
    _discrimination(out, bundle, rules, init, offset)
    reads: list = []
    held = 0

    def check(reads: list) -> None:
        """One batch of windows: padding, paths, moves (the batch bounds the memory a long run takes)."""
        batch = Batch.of(reads, cb, lengths)
        check_padding(batch, layout)
        if m.tree:
            check_tree_paths(batch, leaves, m.state_digest, hashes, sizes)
        else:
            check_paths(batch, layout, roots)
        worst, slack = _check_steps(batch, layout, rules, bundle, offset, n)
        out.worst, out.slack_used = max(out.worst, worst), max(out.slack_used, slack)
        for d, _, _ in reads:
            out.windows += 1
            out.sizes.append(d.size)
            if d.counts:
                out.checked += len(d.steps)
            else:
                out.late += len(d.steps)

    for d in plan.draws:
        if not len(d.steps):
            continue
        path = bundle.online_chunks.get(d.size)
        if path is None:
            if pending_allowed:
                out.pending += len(d.steps)
                out.missing.append(d.size)
                continue
            raise MoveFailure(f"the trainer kept no chunk openings for the window closing at size {d.size} "
                              f"(steps {d.steps.start}..{d.steps.stop - 1}): a chunked run opens chunks of every state "
                              "of every window", step=d.steps.start, window=d.size)
        chunks = layout.select(d.beta, k)  # (over ranks: among the chunks that hold bytes)
        ids = np.asarray(chunks, dtype=np.int64)
        if m.tree:  # every state's nodes, one after the other (a state tree's size may change in a window)
            nodes = sum(int(lengths(t, ids).sum()) for t in range(d.steps.start, d.steps.stop + 1))
        else:
            nodes = int(lengths(0, ids).sum())
        try:
            opened = read_openings(path, d.size, d.steps.start, len(d.steps) + 1, tuple(chunks), cb, nodes,
                                   2 if m.tree else 1)
        except MalformedInput:
            raise
        except VerificationError as e:  # another window's file, or another shape: this window's failure
            raise MoveFailure(e.diagnosis, step=e.step, check=e.check, window=d.size) from None
        reads.append((d, chunks, opened))
        held += opened.chunks.nbytes + opened.paths.nbytes
        if held >= BATCH_BYTES:
            check(reads)
            reads, held = [], 0
    if reads:
        check(reads)
    # openings of a window whose statement the bundle does not hold prove nothing, and are passed over
    # (as the states kept for its steps are): those steps are not audited online, which the bound counts
    out.ignored = sorted(set(bundle.online_chunks) - {d.size for d in plan.draws if len(d.steps)})
    return out


def blind_text(blind: list[list[int]], most: int = 6) -> str:
    """Inclusive step ranges, cut short when many."""
    shown = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in blind[:most])
    return shown + (f", … ({len(blind)} ranges)" if len(blind) > most else "")


# A step whose allowance is more than this many times the run's median allowance is a spike: it lets
# one step move a coordinate as far as that many ordinary steps of the run (cosine, warm-up, one-cycle
# and step decay by 0.1 all stay within it; the red team's spikes were 70x and 20000x).
SPIKE = 10.0


def _discrimination(out: MoveCheck, bundle: Bundle, rules: MoveRules, init: dict[str, torch.Tensor],
                    offset: int) -> None:
    """What the check can tell apart. A step is blind for a tensor where its allowance (lr_t * B_t
    under the tensor's rule) reaches the tensor's own RMS (the larger of the initial state's, which the
    seed fixes, and the final state's, for a tensor that starts at or near zero): that whole tensor fits
    in one step's move. And a step is a spike where its allowance is over ``SPIKE`` times the run's
    median: a model as far from the honest one as that many ordinary steps (a fine-tune of the same
    base, say) fits in it. Either is named in the verdict; only replay checks those steps."""
    n = len(bundle.steps)
    bounded = sorted(name for name, r in rules.rules.items() if r.betas is not None and name in init)
    if not n or not bounded:
        return
    scales = {name: tensor_rms(init[name]) for name in bounded}
    if bundle.complete and n in bundle.checkpoints:  # a tensor that starts near zero is weighed as trained
        from ..bundle.checkpoint import read_checkpoint

        final = read_checkpoint(bundle.checkpoints[n], bounded)  # the parameters only, not the moments
        scales = {name: max(v, tensor_rms(final[name])) if name in final else v for name, v in scales.items()}
    scales = {name: v for name, v in scales.items() if v > 0.0}
    lrs = np.array([r.lr for r in bundle.steps], dtype=np.float64)
    blind = np.zeros(n, dtype=bool)
    largest = np.zeros(n)
    for betas in {rules.rules[name].betas for name in bounded}:
        allowance = lrs * rules.bounds(betas, n, offset)  # type: ignore[arg-type]
        largest = np.fmax(largest, allowance)
        for name in (x for x in bounded if rules.rules[x].betas == betas and x in scales):
            # NaN and inf allowances are blind too, and so is a step whose decay factor 1 - lr x decay is 0 or
            # less (a task's own schedule): its decayed value is no longer near the weight
            hit = ~(allowance < scales[name]) | (lrs * rules.rules[name].decay >= 1)
            if hit.any():
                blind |= hit
                out.blind_tensors.append(name)
    moving = largest[np.isfinite(largest) & (largest > 0)]  # the ordinary steps: those that may move at all
    median = float(np.median(moving)) if moving.size else 0.0
    spikes = ~(largest <= SPIKE * median) if median > 0 else np.zeros(n, dtype=bool)
    if scales:
        out.scale_tensor = min(scales, key=lambda x: (scales[x], x))
        out.scale = scales[out.scale_tensor]
    out.largest_step = int(np.argmax(np.where(np.isnan(largest), np.inf, largest)))
    out.largest = float(largest[out.largest_step])
    out.median = median
    out.blind = step_ranges(blind)
    out.spikes = step_ranges(spikes)
    out.blind_tensors.sort()


def _initial(bundle: Bundle, init: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state that hashes to the manifest's initial state: the seed's, or else the initial checkpoint."""
    m = bundle.manifest
    if same(state_hash(init, m.state_digest), m.init_state_hash):
        return init
    if 0 not in bundle.checkpoints:
        raise MalformedInput("no initial state here hashes to the committed one (the seed's state differs on this "
                             "machine, and the bundle has no initial checkpoint) to open its chunks against")
    from ..bundle.checkpoint import read_checkpoint

    init = read_checkpoint(bundle.checkpoints[0])
    if not same(state_hash(init, m.state_digest), m.init_state_hash):
        raise VerificationError("the initial checkpoint does not hash to the committed state", step=0,
                                check="checkpoint")
    return init


def _roots(bundle: Bundle, layout: ChunkLayout, init: dict[str, torch.Tensor]) -> list[bytes | None]:
    """The param root of every state (version 3): the initial one computed here from the initial state,
    the others the records'."""
    try:
        first = layout.root(init)
    except ValueError as e:  # the committed initial state does not fit the task's model
        raise VerificationError(f"the initial state: {e}", step=0, check="state") from None
    return [first] + [r.param_root for r in bundle.steps]


def _check_steps(batch: Batch, layout: ChunkLayout, rules: MoveRules, bundle: Bundle, offset: int,
                 n: int) -> tuple[float, float]:
    """Every opened coordinate's move in every step of every window, against its bound (a failure
    names the earliest step that moved too far); the largest move as a fraction of what it was
    allowed (among the moves within a thousandth of their bound; 0 if none came that near), and the
    largest share of the rounding slack a move used."""
    cb = layout.chunk_bytes
    lrs = np.array([r.lr for r in bundle.steps], dtype=np.float64)
    diverged = ~np.isfinite(np.array([[r.loss, r.grad_norm] for r in bundle.steps], dtype=np.float64)).all(axis=1)
    tables: dict[tuple[float, float], np.ndarray] = {}
    # a step is a pair of rows: a state's chunk and the same chunk of the state after it (k rows on)
    pairs, row = [], 0
    for _, _, op in batch.reads:
        s, k = op.chunks.shape[:2]
        pairs.append(row + np.arange((s - 1) * k))
        row += s * k
    first_rows = np.concatenate(pairs)
    ks = np.concatenate([np.full((op.chunks.shape[0] - 1) * op.chunks.shape[1], op.chunks.shape[1])
                         for _, _, op in batch.reads])
    step, chunk = batch.state[first_rows], batch.chunk[first_rows]
    tensor = layout.tensor_of(chunk)
    worst = slack = 0.0
    found: list[tuple[int, str, int]] = []  # (step, what moved too far, its window's size), one per tensor
    for i in np.unique(tensor):
        name, dtype, shape = layout.tensors[i]
        rows = np.nonzero(tensor == i)[0]
        esize = _NUMPY[dtype].itemsize
        first = (chunk[rows] - layout.starts[i]) * (cb // esize)
        count = np.minimum(cb // esize, layout.nbytes(i) // esize - first)
        a = batch.data[first_rows[rows]].view(_NUMPY[dtype])
        b = batch.data[first_rows[rows] + ks[rows]].view(_NUMPY[dtype])
        valid = np.arange(cb // esize)[None, :] < count[:, None]
        rule = rules.rules[name]
        t = step[rows]
        lr = lrs[t][:, None]
        if rule.betas is None:
            bound = np.zeros((len(rows), 1))
        else:
            if rule.betas not in tables:
                tables[rule.betas] = rules.bounds(rule.betas, n, offset)
            bound = tables[rule.betas][t][:, None]
        # a screen in the values' own dtype first: only rows with a coordinate within a thousandth of lr * B (or
        # past it, or not finite) are checked exactly, in float64. The screen's rounding is an ulp or so, and the
        # check allows four past lr * B, so no move out of bounds passes it (an honest run's rows fall in it at
        # its tight first step, and where a coordinate moves by as much as the optimizer can)
        # (a chunk that kept every bit was not stepped, decay and all: torch skips a parameter without a gradient;
        # ``move_limits`` says why)
        with np.errstate(invalid="ignore", over="ignore"):
            rough = np.abs(b - a * (1.0 - lr * rule.decay).astype(a.dtype))
            near = (valid & ~skipped(a, b) & ~(rough <= (0.999 * lr * bound).astype(a.dtype))).any(axis=1)
        sel = np.nonzero(near)[0]
        rows, a, b, valid, t, lr, bound, first = (x[sel] for x in (rows, a, b, valid, t, lr, bound, first))
        moved, allowed = move_limits(a, b, lr, bound, rule.decay, _NUMPY[dtype])
        # no step of the optimizer takes a finite value to +-inf; a NaN is an honest step's only where the step
        # diverged (its loss or gradient norm is not finite: NaN gradients make every moved value NaN)
        bad = valid & ~(moved <= allowed) & ~(np.isnan(b) & diverged[t][:, None])
        if rule.betas is None:  # no optimizer group holds it: not a bit may change (not 0.0 to -0.0)
            bad |= valid & ~unchanged(a, b)
        if bad.any():
            hits = np.argwhere(bad)
            r, c = (int(x) for x in hits[np.argmin(t[hits[:, 0]])])  # this tensor's earliest step
            coord = tuple(int(x) for x in np.unravel_index(int(first[r]) + c, shape)) if shape else ()
            if coord and layout.rows is not None and layout.rows[i] is not None:  # a rank's rows: its place in the whole
                coord = (coord[0] + layout.rows[i][0], *coord[1:])
            limit = "may not move at all (no optimizer group holds it)" if rule.betas is None else \
                f"may move {allowed[r, c]:.3g} (lr {lrs[t[r]]:.3g} x B {float(bound[r, 0]):.4g}" + \
                (f", after the decay by lr x {rule.decay:g}" if rule.decay else "") + ")"
            found.append((int(t[r]), f"{name}{list(coord)} moved from {float(a[r, c])!r} to {float(b[r, c])!r}, "
                                     f"{moved[r, c]:.3g} in one step where it {limit}: no step of {rules.optimizer} "
                                     "moves a coordinate that far, whatever its gradient",
                          batch.where(int(first_rows[rows[r]]))[0].size))
            continue
        ok = valid & (allowed > 0) & np.isfinite(moved)
        if ok.any():
            worst = max(worst, float((moved[ok] / allowed[ok]).max()))
            exact = np.broadcast_to(lr * bound, moved.shape)
            room = allowed - exact
            slack = max(slack, float(((moved - exact)[ok & (room > 0)] / room[ok & (room > 0)]).max(initial=0.0)))
    if found:
        t, why, window = min(found)
        raise MoveFailure(why, step=t, window=window)
    return worst, slack
