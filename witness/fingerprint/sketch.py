"""A seeded linear sketch of the parameters: linear, so sketches of shards sum to the whole.

The sketch is ``R @ theta[S]``: a fixed seeded set ``S`` of coordinates (spread over every
tensor in proportion to its size) projected by a Gaussian ``k x |S|`` matrix. It is linear in
the parameters, costs O(|S|) rather than O(parameters) per step, and each shard of a sharded
tensor contributes the part of ``S`` it holds.

A plain matrix-vector product splits its reduction across threads, so its last bits depend on
the thread count. Here each fixed-size chunk is reduced in a fixed order and the chunk sums are
added with ``math.fsum`` (exactly rounded, order-free): the same state gives the same bits at any
thread count.
"""

from __future__ import annotations

import math

import torch

from ..commit.hashing import tagged_hash

CHUNK = 256
DEFAULT_COORDS = 16384


def _seed(*parts: bytes) -> int:
    return int.from_bytes(tagged_hash("witness/sketch/v2", *parts)[:8], "big") >> 1


class ParameterSketch:
    """``k`` Gaussian projections of a seeded sample of the parameter coordinates."""

    def __init__(self, seed: bytes, k: int = 8, coords: int = DEFAULT_COORDS):
        self.seed, self.k, self.coords = seed, k, coords
        self._plan: tuple[dict[str, tuple[torch.Tensor, int]], torch.Tensor] = ({}, torch.zeros(0))
        self._shape: tuple[tuple[str, int], ...] | None = None
        self._index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self, sizes: dict[str, int]) -> tuple[dict[str, tuple[torch.Tensor, int]], torch.Tensor]:
        """Per tensor: its sampled flat positions and offset in the gather buffer; and the (k, chunks, CHUNK) projection."""
        shape = tuple(sorted(sizes.items()))
        if shape == self._shape:
            return self._plan
        total = sum(sizes.values()) or 1
        positions: dict[str, tuple[torch.Tensor, int]] = {}
        blocks = []
        offset = 0
        for name, n in shape:
            count = min(n, max(1, math.ceil(self.coords * n / total)))
            g = torch.Generator().manual_seed(_seed(self.seed, name.encode(), n.to_bytes(8, "big")))
            pos = torch.randperm(n, generator=g)[:count].sort().values
            padded = -(-count // CHUNK) * CHUNK  # chunks never straddle two tensors: shards stay separable
            r = torch.zeros(self.k, padded, dtype=torch.float64)
            r[:, :count] = torch.randn(self.k, count, generator=g, dtype=torch.float32).to(torch.float64)
            blocks.append(r)
            positions[name] = (pos, offset)
            offset += padded
        proj = torch.cat(blocks, dim=1).view(self.k, -1, CHUNK) if blocks else torch.zeros(self.k, 0, CHUNK, dtype=torch.float64)
        self._plan, self._shape = (positions, proj), shape
        self._index_cache = {}
        return self._plan

    @torch.no_grad()
    def __call__(self, named_tensors: dict[str, torch.Tensor]) -> list[float]:
        """The sketch of a state, as ``k`` floats."""
        return self.project(self.gather({n: (t, 0, t.numel()) for n, t in named_tensors.items()}))

    @torch.no_grad()
    def gather(self, pieces: dict[str, tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """The sampled coordinates as one float64 vector, from (tensor or shard, flat offset, full size).

        A shard fills the coordinates it holds and leaves zeros elsewhere, so the ranks' vectors
        add up (exactly: every coordinate comes from one rank) to the full one.
        """
        floating = {n: v for n, v in pieces.items() if v[0].is_floating_point()}
        positions, proj = self.plan({n: full for n, (_, _, full) in floating.items()})
        x = torch.zeros(proj.shape[1] * CHUNK, dtype=torch.float64)
        # On an accelerator, per-tensor copies to the host would each wait for the device: the
        # selected values are gathered there and cross once per device (values are copied, and
        # widening to float64 is exact, so the bits are those of a per-tensor gather).
        dests: dict[torch.device, list[torch.Tensor]] = {}
        values: dict[torch.device, list[torch.Tensor]] = {}
        for name, (t, lo, full) in floating.items():
            flat = t.detach().reshape(-1)
            dest, local = self._indices(name, positions[name], lo, flat.numel(), full, flat.device)
            dests.setdefault(flat.device, []).append(dest)
            values.setdefault(flat.device, []).append(flat.index_select(0, local).to(torch.float64))
        for dev, vals in values.items():
            x[torch.cat(dests[dev])] = torch.cat(vals).cpu()
        return x

    def _indices(self, name: str, plan: tuple[torch.Tensor, int], lo: int, n: int, full: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a tensor's (or shard's) sampled values go in the gather buffer, and where they are
        in it (on its device); cached, since a run's shards keep their offsets."""
        key = (name, lo, n, full, str(device))
        hit = self._index_cache.get(key)
        if hit is None:
            pos, offset = plan
            mine = torch.nonzero((pos >= lo) & (pos < lo + n)).reshape(-1)
            hit = (offset + mine, (pos[mine] - lo).to(device))
            self._index_cache[key] = hit
        return hit

    def project(self, x: torch.Tensor) -> list[float]:
        """Project gathered coordinates; exactly rounded, so independent of the thread count."""
        proj = self._plan[1]
        partial = (proj * x.view(1, -1, CHUNK)).sum(dim=2)
        return [math.fsum(row) for row in partial.tolist()]
