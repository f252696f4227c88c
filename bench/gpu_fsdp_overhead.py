"""GPU benchmark: the recorder's overhead on a ~100M-parameter GPT trained with FSDP2.

Ready to run on a machine with one NVIDIA GPU (nccl), in one run:

    torchrun --nproc_per_node=1 bench/gpu_fsdp_overhead.py --json gpu.json

It builds tinygpt's GPT (12 layers, d_model 768, 12 heads, block 1024: 86 M parameters) on the
GPU, shards every block and the root with ``fully_shard``, and alternates plain and witnessed
steps in ABBA blocks. A witnessed step adds what the recorder does each step: the batch root,
the probe forward (4 probes x 32 tokens: 0.78 % of the 16 x 1024 batch tokens), the digest of
the probe outputs, the sampled-coordinate parameter sketch, and one canonical JSON record
appended to the Merkle log. Checkpoint writes (the trainer's own cost) are left out. A smoke test on CPU:

    torchrun --nproc_per_node=1 bench/gpu_fsdp_overhead.py --device cpu --small
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import parser, report

from witness.commit.hashing import canonical_json
from witness.commit.log import RunLog
from witness.data.dataset import batch_root, sample_hash
from witness.fingerprint.probes import fingerprint_from_outputs, projection_matrix
from witness.fingerprint.sketch import ParameterSketch
from witness.task.tinygpt import GPT, TinyGPTConfig


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model, for a smoke test")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--probe-len", type=int, default=32)
    ap.add_argument("--sketch-ab", action="store_true",
                    help="only time the sketch's gather against one host copy per tensor, alternating")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{dist.get_rank()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    c = (TinyGPTConfig(n_layer=2, d_model=64, n_head=4, block=128, dropout=0.0) if args.small else
         TinyGPTConfig(n_layer=12, d_model=768, n_head=12, block=1024, dropout=0.0))
    from torch.distributed.fsdp import fully_shard

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(c).to(device)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    plain, plain_opt = build()
    witnessed, wit_opt = build()
    params = sum(p.numel() for p in plain.parameters())
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4096, c.block + 1), generator=gen, dtype=torch.uint8)
    probes = torch.randint(0, 256, (args.probes, args.probe_len + 1), generator=gen).to(device)
    proj = projection_matrix(b"bench", 256, 8)
    sketcher = ParameterSketch(b"bench")
    log = RunLog()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(model, opt, t: int) -> torch.Tensor:
        rows = data[(t * args.batch) % 4096 : (t * args.batch) % 4096 + args.batch]
        x = rows.to(device=device, dtype=torch.long)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    offsets: dict[int, dict[str, int]] = {}

    def shard_sketch(model) -> list[float]:
        # as DistSession does: the shards' offsets once per run, then only the sampled values move
        if id(model) not in offsets:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            offsets[id(model)] = {
                name: compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
                * (p[0].numel() if p.dim() else 1) for name, p in model.named_parameters()}
        pieces = {n: (p.to_local(), offsets[id(model)][n], p.numel()) for n, p in model.named_parameters()}
        return sketcher.project(sketcher.gather(pieces))

    parts: dict[str, list[float]] = {"batch_root": [], "probe_fingerprint": [], "sketch": [], "log_record": []}

    def witness_work(model, t: int, loss: torch.Tensor) -> None:
        # each part ends by synchronizing (the fingerprint and the sketch move to the CPU anyway),
        # so the breakdown adds no waiting of its own
        marks = [time.perf_counter()]
        rows = data[(t * args.batch) % 4096 : (t * args.batch) % 4096 + args.batch]
        root = batch_root([sample_hash(bytes(r.tolist())) for r in rows])
        marks.append(time.perf_counter())
        with torch.no_grad():
            out = model(probes[:, :-1])
            model.reshard()
            losses = F.cross_entropy(out.transpose(1, 2), probes[:, 1:], reduction="none").mean(dim=1)
            fp = fingerprint_from_outputs(out.float().cpu(), losses.cpu(), proj)
            marks.append(time.perf_counter())
            sk = shard_sketch(model)
            marks.append(time.perf_counter())
        log.append({"type": "step", "step": t, "batch_root": root.hex(), "loss": float(loss.detach()),
                    "fingerprint": fp.to_json(), "sketch": sk})
        hashlib.sha256(canonical_json({"probe": fp.digest})).digest()
        marks.append(time.perf_counter())
        for name, a, b in zip(parts, marks[:-1], marks[1:], strict=True):
            parts[name].append(b - a)

    if args.sketch_ab:
        sketch_ab(witnessed, sketcher, sync, args.json)
        dist.destroy_process_group()
        return

    for t in range(3):  # warm-up: allocator, kernels, the sketch plan
        step(plain, plain_opt, t)
        witness_work(witnessed, t, step(witnessed, wit_opt, t))
    sync()
    for v in parts.values():
        v.clear()
    plain_t, wit_t, extra_t = [], [], []
    t = 3
    for r in range(args.rounds):
        for path in (("p", "w") if r % 2 == 0 else ("w", "p")):
            for _ in range(args.block_steps):
                sync()
                a = time.perf_counter()
                if path == "p":
                    step(plain, plain_opt, t)
                    sync()
                    plain_t.append(time.perf_counter() - a)
                else:
                    loss = step(witnessed, wit_opt, t)
                    sync()
                    b = time.perf_counter()
                    witness_work(witnessed, t, loss)
                    sync()
                    e = time.perf_counter()
                    wit_t.append(e - a)
                    extra_t.append(e - b)
                t += 1
    same_sketch = None
    with torch.no_grad():  # the sketch read from the device's shards is the one of the state on the CPU
        full = {n: p.full_tensor().cpu() for n, p in witnessed.named_parameters()}
        if dist.get_world_size() == 1:  # with more ranks each holds a part; the parts add up
            same_sketch = shard_sketch(witnessed) == sketcher(full)
    if dist.get_rank() == 0:
        p, w, x = statistics.median(plain_t), statistics.median(wit_t), statistics.median(extra_t)
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        report({"device": name, "parameters": params, "tokens_per_step": args.batch * c.block,
                "probe_tokens": args.probes * args.probe_len, "plain_step_s": p, "witnessed_step_s": w,
                "recorder_added_s": x, "overhead_ratio": x / p, "wallclock_ratio": w / p - 1,
                "recorder_parts_s": {k: statistics.median(v) for k, v in parts.items()},
                "sketch_on_device_equals_cpu": same_sketch}, args.json)
    dist.destroy_process_group()


@torch.no_grad()
def sketch_ab(model, sketcher: ParameterSketch, sync, json_path: str | None) -> None:  # noqa: ANN001
    """The library's gather (one device-to-host copy) against one host copy per tensor, alternating."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def pieces() -> dict:
        out = {}
        for name, p in model.named_parameters():
            _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = (p.to_local(), off[0] * (p[0].numel() if p.dim() else 1), p.numel())
        return out

    def per_tensor(pcs: dict) -> torch.Tensor:
        positions, proj = sketcher.plan({n: full for n, (_, _, full) in pcs.items()})
        x = torch.zeros(proj.shape[1] * 256, dtype=torch.float64)
        for name, (t, lo, _full) in pcs.items():
            pos, offset = positions[name]
            flat = t.reshape(-1)
            idx = torch.nonzero((pos >= lo) & (pos < lo + flat.numel())).reshape(-1)
            x[offset + idx] = flat.index_select(0, (pos[idx] - lo).to(flat.device)).cpu().to(torch.float64)
        return x

    times: dict[str, list[float]] = {"offsets": [], "gather_one_copy": [], "gather_per_tensor": []}
    pcs = pieces()
    assert torch.equal(sketcher.gather(pcs), per_tensor(pcs))
    for i in range(60):
        sync()
        a = time.perf_counter()
        pcs = pieces()
        b = time.perf_counter()
        for name in (("gather_one_copy", "gather_per_tensor") if i % 2 else ("gather_per_tensor", "gather_one_copy")):
            sync()
            c = time.perf_counter()
            sketcher.gather(pcs) if name == "gather_one_copy" else per_tensor(pcs)
            sync()
            if i >= 10:
                times[name].append(time.perf_counter() - c)
        if i >= 10:
            times["offsets"].append(b - a)
    if dist.get_rank() == 0:
        report({k: statistics.median(v) for k, v in times.items()}, json_path)


if __name__ == "__main__":
    main()
