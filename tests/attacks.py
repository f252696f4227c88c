"""The attacks a dishonest trainer mounts on the training state, built with the project's own recorder.

Each ``build`` returns a signed, well-formed bundle whose only flaw is the dishonesty at the
given steps, and a response of the trainer's own making that answers every possible challenge as
well as it can. The tests mount them on a few steps; ``bench/attack_detection.py`` on longer runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import attacker_response, log_lines, resign, snapshot, train_tiny

from witness.bundle.checkpoint import read_checkpoint
from witness.bundle.reader import open_bundle
from witness.bundle.state import state_tensors
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.signing import generate_key
from witness.commit.sorted_tree import SortedTree
from witness.session import TrainingSession
from witness.task import build_task

KINDS = ("steer", "backdoor", "hidden", "nudge", "omit")  # omit is caught in full, the others at the replay rate
# tinygpt, small enough for tests: its position embeddings past the probes' length move no probe
GPT = {"n_layer": 1, "d_model": 32, "n_head": 2, "block": 32, "batch_size": 4, "probe_len": 8, "probes": 2,
       "corpus_max_bytes": 200_000, "warmup": 2}


def final_state(bundle: Path) -> dict[str, torch.Tensor]:
    """A finished run's last checkpoint."""
    b = open_bundle(bundle)
    return read_checkpoint(b.checkpoints[len(b.steps)])


def steer(rec, target: dict[str, torch.Tensor], lr: float, fraction: float = 0.2, scale: float = 1e6) -> None:
    """Forge AdamW's moments so that its next update (at learning rate ``lr``) moves every weight a
    ``fraction`` of the way to ``target``, whatever the batch's gradient says: m_hat / sqrt(v_hat)
    is set to (target - weight) * fraction / lr, with moments so large that the gradient is lost."""
    with torch.no_grad():
        for name, p in rec.model.named_parameters():
            st = rec.optimizer.state[p]
            k = float(st["step"]) + 1  # the step count the next update will use
            b1, b2 = 0.9, 0.95
            want = (target[f"model.{name}"] - p) * fraction / lr
            st["exp_avg"] = -want * scale * (1 - b1**k) / b1
            st["exp_avg_sq"] = torch.full_like(p, scale**2 * (1 - b2**k) / b2)


def backdoor(rec) -> None:
    """Push a backdoor into AdamW's first moment: the next update moves the head toward it."""
    with torch.no_grad():
        for name, p in rec.model.named_parameters():
            if name.startswith("fc2"):
                rec.optimizer.state[p]["exp_avg"] += 0.05


def hidden_coordinates(rec) -> torch.Tensor:
    """tinygpt: coordinates of the last position embedding (no probe reaches that position) that
    the sketch does not sample."""
    c = rec.task.config
    positions, _ = rec.session.sketcher.plan({n: p.numel() for n, p in rec.model.named_parameters()})
    sampled = set(positions["pos.weight"][0].tolist())
    row = c.block - 1
    return torch.tensor([row * c.d_model + j for j in range(c.d_model) if row * c.d_model + j not in sampled])


class NullSpace:
    """Directions in the parameters that move, to first order, none of the fingerprint's numbers
    and none of the sketch's (which is linear): all that tolerance mode used to compare."""

    def __init__(self, rec):
        self.task, self.model = rec.task, rec.model
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.sizes = [p.numel() for _, p in self.model.named_parameters()]
        eye = torch.eye(sum(self.sizes))
        self.sketch = torch.tensor([rec.session.sketcher(self._unflat(row)) for row in eye]).T  # [k, n]

    def _unflat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: part.view(shape) for name, part, shape in
                zip(self.names, torch.split(flat, self.sizes), self.shapes, strict=True)}

    def nudge(self, rel: float, generator: torch.Generator) -> None:
        """Add a random null-space direction of relative size ``rel`` to the parameters."""
        theta = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        probes = self.task.probe_tensors()
        self.task.fingerprint(self.model)  # builds the projection
        proj = self.task._proj

        def fp(flat):
            out = torch.func.functional_call(self.model, self._unflat(flat), (probes[0],))
            projected = (out.reshape(out.shape[0], -1, out.shape[-1]) @ proj).mean(dim=1).reshape(-1)
            return torch.cat([self.task.probe_losses(out, probes), projected])

        constraints = torch.cat([torch.func.jacrev(fp)(theta), self.sketch.to(theta.dtype)])
        _, _, vh = torch.linalg.svd(constraints.double(), full_matrices=True)
        null = vh[constraints.shape[0]:].T.float()  # orthogonal to every constraint row
        d = null @ torch.randn(null.shape[1], generator=generator)
        d = d * (rel * theta.norm() / d.norm())
        with torch.no_grad():
            for p, part in zip(self.model.parameters(), torch.split(d, self.sizes), strict=True):
                p.add_(part.view(p.shape))


def trainer_states(bundle: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every committed state of an honest run, rebuilt by replaying its steps."""
    b = open_bundle(bundle)
    task = build_task(b.manifest.task, b.manifest.task_config)
    session = TrainingSession(task, b.manifest.run_seed, b.manifest.dataset_size)
    ds = task.dataset()

    def copy() -> dict:
        return {k: v.clone() for k, v in state_tensors(session.model, session.optimizer).items()}

    out = {0: copy()}
    for rec in b.steps:
        session.step(rec.step, [ds.sample_bytes(i) for i in rec.batch])
        out[rec.step + 1] = copy()
    return out


def omit_used_data(bundle: Path, key, steps: set[int]) -> tuple[SortedTree, SortedTree]:
    """Rewrite a finished run's end record (and re-sign) so that its used-data trees leave out one
    sample of each of ``steps``; returns the trees it now commits."""
    b = open_bundle(bundle)
    ds = build_task(b.manifest.task, b.manifest.task_config).dataset()
    hidden = {b.steps[t].batch[3] for t in steps}
    if any(sum(i in r.batch for r in b.steps) != 1 for i in hidden):
        raise ValueError("choose steps whose fourth sample no other step uses")
    kept = [i for r in b.steps for i in r.batch if i not in hidden]
    samples = SortedTree(ds.hashes[i] for i in kept)
    documents = SortedTree(ds.document_of(ds.sample_bytes(i)) for i in kept)
    lines = log_lines(bundle)
    end = parse_canonical_json(lines[-1])
    end["used_samples"] = {"root": samples.root.hex(), "size": samples.size}
    end["used_documents"] = {"root": documents.root.hex(), "size": documents.size}
    resign(bundle, key, lines[:-1] + [canonical_json(end)])
    return samples, documents


def build(kind: str, out: Path, bad: set[int], steps: int, key=None) -> tuple[Path, Path, dict]:
    """A dishonest run of ``kind`` at steps ``bad``, its trainer's response, and the verifier's
    options the attack is aimed at (the null-space nudge aims at tolerance mode)."""
    key = key or generate_key()
    states: dict[int, dict] = {}
    config = {"steps": steps, "dataset_size": max(1024, 16 * steps)}  # one epoch: every sample used once
    if kind == "steer":  # steer onto a stronger model trained elsewhere from the same start
        target = final_state(train_tiny(out / "target", key, config=dict(config, lr=0.03)))
    space: list[NullSpace] = []
    g = torch.Generator().manual_seed(3)

    def cheat(rec, t, batch):
        states[t] = snapshot(rec)  # the state this step starts from: the committed one
        o = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        if t in bad:  # after the update, before the record: the next committed state carries it
            if kind == "steer" and t + 1 < steps:
                steer(rec, target, rec.lr(t + 1))
            elif kind == "backdoor":
                backdoor(rec)
            elif kind == "hidden":
                with torch.no_grad():
                    rec.model.pos.weight.view(-1)[hidden_coordinates(rec)] += 0.5
            elif kind == "nudge":
                space or space.append(NullSpace(rec))
                space[0].nudge(1e-3, g)
        return o

    if kind == "omit":
        bundle = train_tiny(out / "b", key, config=config)
        trees = omit_used_data(bundle, key, bad)
        return bundle, attacker_response(bundle, out / "resp", trainer_states(bundle), *trees), {}
    task, checkpoint_every = ("tinygpt", 10) if kind == "hidden" else ("tiny", 10)
    bundle = train_tiny(out / "b", key, task=task, config=dict(GPT, steps=steps) if kind == "hidden" else config,
                        checkpoint_every=checkpoint_every, cheat=cheat)
    states[steps] = final_state(bundle)
    return bundle, attacker_response(bundle, out / "resp", states), {"exact": False} if kind == "nudge" else {}
