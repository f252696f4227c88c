"""The parameter sketch: exactly the seeded projection of the sampled coordinates, and shard-additive."""

from __future__ import annotations

import torch

from witness.fingerprint.sketch import CHUNK, ParameterSketch


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(300, 17, generator=g), "w": torch.randn(64, 64, generator=g),
            "b": torch.randn(64, generator=g), "steps": torch.tensor(3)}  # an integer buffer is left out


def _reference(sk: ParameterSketch, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The definition, written out: theta[S] placed at each tensor's offset of the buffer."""
    floating = {n: t for n, t in state.items() if t.is_floating_point()}
    positions, proj = sk.plan({n: t.numel() for n, t in floating.items()})
    x = torch.zeros(proj.shape[1] * CHUNK, dtype=torch.float64)
    for name, t in floating.items():
        pos, offset = positions[name]
        x[offset : offset + pos.numel()] = t.reshape(-1)[pos].to(torch.float64)
    return x


def test_gather_is_the_sampled_coordinates_and_shards_add_up():
    sk = ParameterSketch(b"seed", coords=2000)
    state = _state(0)
    whole = sk.gather({n: (t, 0, t.numel()) for n, t in state.items()})
    assert torch.equal(whole, _reference(sk, state))
    assert whole.count_nonzero() > 1000
    # three uneven flat shards per tensor, as FSDP holds them: each fills only its own coordinates
    parts = []
    for cut in ((0, 5, 9), (1, 2, 3)):
        pieces: list[dict] = [{}, {}, {}]
        for name, t in state.items():
            flat = t.reshape(-1)
            bounds = [0, *sorted({min(c * flat.numel() // 10, flat.numel()) for c in cut[1:]}), flat.numel()]
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=False)):
                pieces[i][name] = (flat[a:b], a, flat.numel())
        parts.append(sum(sk.gather(p) for p in pieces))
    assert all(torch.equal(p, whole) for p in parts)
    assert sk(state) == sk.project(whole)


def test_a_change_of_parameters_or_of_shapes_is_seen():
    sk = ParameterSketch(b"seed", coords=2000)
    a, b = _state(0), _state(0)
    first = sk(a)
    pos, _ = sk.plan({n: t.numel() for n, t in a.items() if t.is_floating_point()})[0]["w"]
    b["w"].view(-1)[pos[0]] += 1.0  # one sampled coordinate moves
    assert sk(b) != first and sk(a) == first
    grown = dict(a, w=torch.randn(65, 64))  # another shape: a new plan, no stale cached indices
    assert torch.equal(sk.gather({n: (t, 0, t.numel()) for n, t in grown.items()}), _reference(sk, grown))


def test_half_precision_values_are_widened_exactly():
    sk = ParameterSketch(b"seed", coords=500)
    state = {n: t.to(torch.bfloat16) for n, t in _state(1).items() if t.is_floating_point()}
    widened = {n: t.to(torch.float32) for n, t in state.items()}
    assert sk(state) == sk(widened)
