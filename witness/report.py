"""A small human-readable report of a bundle: plots of loss and probe fingerprints."""

from __future__ import annotations

import os
from pathlib import Path

from .bundle.reader import Bundle


def plot_loss(bundle: Bundle, path: str | os.PathLike, challenged: list[tuple[int, bool]] | None = None) -> Path:
    """The training loss, checkpoints and replayed steps; the format follows the suffix (png, svg)."""
    steps = [r.step for r in bundle.steps]
    fig = _figure((7, 3.5))
    ax = fig.subplots()
    ax.plot(steps, [r.loss for r in bundle.steps], lw=1, label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    for c in (c for c in bundle.checkpoint_steps() if c > 0):
        ax.axvline(c, color="grey", lw=0.5, ls=":")
    if challenged:
        by_step = {r.step: r.loss for r in bundle.steps}
        ok = [(t, by_step[t]) for t, passed in challenged if passed and t in by_step]
        bad = [(t, by_step[t]) for t, passed in challenged if not passed and t in by_step]
        if ok:
            ax.scatter(*zip(*ok, strict=True), s=12, color="tab:green", zorder=3, label="replayed: matched")
        if bad:
            ax.scatter(*zip(*bad, strict=True), s=24, color="tab:red", marker="x", zorder=3, label="replayed: MISMATCH")
    ax.set_title(f"{bundle.manifest.task}: loss (dotted lines: committed checkpoints)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_fingerprints(bundle: Bundle, path: str | os.PathLike) -> Path:
    """The behavioral fingerprint over training: per-probe loss and projected outputs."""
    steps = [r.step for r in bundle.steps]
    fig = _figure((10, 3.5))
    a1, a2 = fig.subplots(1, 2)
    for p in range(len(bundle.steps[0].probe_loss)):
        a1.plot(steps, [r.probe_loss[p] for r in bundle.steps], lw=1, label=f"probe {p}")
    a1.set_title("behavioral fingerprint: loss on each probe")
    a1.set_xlabel("step")
    a1.legend(fontsize=7)
    for d in range(min(len(bundle.steps[0].projection), 8)):
        a2.plot(steps, [r.projection[d] for r in bundle.steps], lw=1)
    a2.set_title("behavioral fingerprint: projected outputs")
    a2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def _figure(size: tuple[float, float]):
    """A figure outside pyplot: no global state, safe in a long-running server's threads."""
    from matplotlib.figure import Figure

    return Figure(figsize=size)


def write_report(bundle: Bundle, out: str | os.PathLike, verdict_text: str = "",
                 challenged: list[tuple[int, bool]] | None = None) -> Path:
    """Write ``loss.png``, ``fingerprints.png`` and ``report.md`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(bundle, out / "loss.png", challenged)
    plot_fingerprints(bundle, out / "fingerprints.png")

    m = bundle.manifest
    text = [
        f"# Witness report: {m.task}",
        "",
        f"* steps signed: {len(bundle.steps)} of {m.steps_planned} ({'complete' if bundle.complete else 'incomplete'})",
        f"* final tree head: size {bundle.final_head.size}, root `{bundle.final_head.root.hex()}`",
        f"* data root: `{m.data_root.hex()}` ({m.dataset_size} samples)",
        f"* run seed: `{m.run_seed.hex()}` = H(data root ‖ r), r from the {m.r_source}",
        f"* checkpoints: {', '.join(str(c) for c in bundle.checkpoint_steps())}",
        f"* final loss: {bundle.steps[-1].loss:.4f}",
        "",
        "![loss](loss.png)",
        "",
        "![fingerprints](fingerprints.png)",
        "",
    ]
    if verdict_text:
        text += ["## Verdict", "", "```", verdict_text, "```", ""]
    (out / "report.md").write_text("\n".join(text))
    return out
