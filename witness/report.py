"""A human-readable report of a bundle: plots of loss, schedule, gradient norm and fingerprints.

``write_report`` writes ``report.md`` beside PNG plots, and ``report.html`` with the same plots
inline as SVG, so that one file can be mailed or attached to a paper's artifacts.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from .bundle.reader import Bundle

FINGERPRINT_CAPTION = (
    "The behavioral fingerprint: after every step the recorder runs the model on a small probe set "
    "committed before training and logs its outputs. Left, the loss on each probe; right, the outputs "
    "projected onto a few fixed random directions. A replay challenge recomputes these numbers from the "
    "committed state: a run that was not trained as logged gives other outputs, so they cannot be "
    "invented after the fact. Smooth curves that settle as the loss falls are what honest training looks like."
)
OPTIMIZER_CAPTION = (
    "The learning rate the verifier recomputed from the recipe's schedule for every step, and the norm of "
    "the gradient the trainer logged (log scale): spikes show unstable steps."
)


def plot_loss(bundle: Bundle, path: str | os.PathLike | io.IOBase, challenged: list[tuple[int, bool]] | None = None,
              evaluation: dict | None = None) -> Path | None:
    """The training loss, checkpoints, replayed steps and the certified evaluation loss (png or svg)."""
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
    if evaluation and isinstance(evaluation.get("mean_loss"), (int, float)) and steps:
        ax.scatter([steps[-1]], [evaluation["mean_loss"]], s=60, marker="*", color="tab:purple", zorder=4,
                   label=f"certified evaluation loss {evaluation['mean_loss']:.4f}")
    ax.set_title(f"{bundle.manifest.task}: loss (dotted lines: committed checkpoints)")
    ax.legend()
    return _save(fig, path)


def plot_optimizer(bundle: Bundle, path: str | os.PathLike | io.IOBase) -> Path | None:
    """The learning rate and the gradient norm per step."""
    steps = [r.step for r in bundle.steps]
    fig = _figure((10, 3.2))
    a1, a2 = fig.subplots(1, 2)
    a1.plot(steps, [r.lr for r in bundle.steps], lw=1, color="tab:orange")
    a1.set_title("learning rate (the recipe's schedule)")
    a1.set_xlabel("step")
    a1.set_ylabel("learning rate")
    a2.plot(steps, [r.grad_norm for r in bundle.steps], lw=1, color="tab:brown")
    if all(r.grad_norm > 0 for r in bundle.steps):
        a2.set_yscale("log")
    a2.set_title("gradient norm (before clipping)")
    a2.set_xlabel("step")
    a2.set_ylabel("‖gradient‖₂")
    return _save(fig, path)


def plot_fingerprints(bundle: Bundle, path: str | os.PathLike | io.IOBase) -> Path | None:
    """The behavioral fingerprint over training: per-probe loss and projected outputs."""
    steps = [r.step for r in bundle.steps]
    fig = _figure((10, 3.5))
    a1, a2 = fig.subplots(1, 2)
    for p in range(len(bundle.steps[0].probe_loss)):
        a1.plot(steps, [r.probe_loss[p] for r in bundle.steps], lw=1, label=f"probe {p}")
    a1.set_title("fingerprint: the model's loss on each probe")
    a1.set_xlabel("step")
    a1.set_ylabel("loss on the probe")
    a1.legend(fontsize=7)
    for d in range(min(len(bundle.steps[0].projection), 8)):
        a2.plot(steps, [r.projection[d] for r in bundle.steps], lw=1)
    a2.set_title("fingerprint: outputs along fixed random directions")
    a2.set_xlabel("step")
    a2.set_ylabel("projected output")
    return _save(fig, path)


def _figure(size: tuple[float, float]):
    """A figure outside pyplot: no global state, safe in a long-running server's threads."""
    from matplotlib.figure import Figure

    return Figure(figsize=size)


def _save(fig, path: str | os.PathLike | io.IOBase) -> Path | None:
    fig.tight_layout()
    if isinstance(path, io.IOBase):
        fig.savefig(path, format="svg")
        return None
    fig.savefig(path, dpi=110)
    return Path(path)


def _inline_svg(plot) -> str:
    """A plot (a function of where to draw) as SVG markup to embed in HTML, without the XML prologue."""
    buf = io.StringIO()
    plot(buf)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def write_report(bundle: Bundle, out: str | os.PathLike, verdict_text: str = "",
                 challenged: list[tuple[int, bool]] | None = None, evaluation: dict | None = None) -> Path:
    """Write ``report.md`` with ``loss.png``, ``optimizer.png`` and ``fingerprints.png``, and
    ``report.html`` with the plots inline. ``evaluation`` is a certificate's aggregates."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(bundle, out / "loss.png", challenged, evaluation)
    plot_optimizer(bundle, out / "optimizer.png")
    plot_fingerprints(bundle, out / "fingerprints.png")

    m = bundle.manifest
    facts = [
        ("steps signed", f"{len(bundle.steps)} of {m.steps_planned} ({'complete' if bundle.complete else 'incomplete'})"),
        ("final tree head", f"size {bundle.final_head.size}, root {bundle.final_head.root.hex()}"),
        ("data root", f"{m.data_root.hex()} ({m.dataset_size} samples)"),
        ("run seed", f"{m.run_seed.hex()} = H(data root ‖ r), r from the {m.r_source}"),
        ("checkpoints", ", ".join(str(c) for c in bundle.checkpoint_steps())),
        ("final training loss", f"{bundle.steps[-1].loss:.4f}"),
    ]
    facts += [(f"evaluation: {k}", f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in (evaluation or {}).items()]
    text = [f"# Witness report: {m.task}", ""]
    text += [f"* {k}: {v}" for k, v in facts]
    text += ["", "![loss](loss.png)", "", "![learning rate and gradient norm](optimizer.png)", "",
             f"*{OPTIMIZER_CAPTION}*", "", "![fingerprints](fingerprints.png)", "", f"*{FINGERPRINT_CAPTION}*", ""]
    if verdict_text:
        text += ["## Verdict", "", "```", verdict_text, "```", ""]
    (out / "report.md").write_text("\n".join(text))

    env = Environment(loader=PackageLoader("witness", "templates"), autoescape=select_autoescape(["html"]))
    html = env.get_template("report.html").render(
        task=m.task, facts=facts, verdict=verdict_text,
        loss_svg=_inline_svg(lambda f: plot_loss(bundle, f, challenged, evaluation)),
        optimizer_svg=_inline_svg(lambda f: plot_optimizer(bundle, f)),
        fingerprints_svg=_inline_svg(lambda f: plot_fingerprints(bundle, f)),
        optimizer_caption=OPTIMIZER_CAPTION, fingerprint_caption=FINGERPRINT_CAPTION,
    )
    (out / "report.html").write_text(html)
    return out
