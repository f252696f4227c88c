"""The one-pass commitment on a GPU: the Triton kernel's BLAKE3 tree (``witness.fingerprint.b3gpu``) over
a buffer, and over a whole training state of GPT-2 124 M and of 1.2 B parameters (parameters and
AdamW's two moments, float32), against hashing the same bytes on the host.

For each: the kernel's GB/s (chunk chaining values, then every parent level, then the root, all on the
device; only the 32-byte digests cross), the host's (the state copied to the host, then the ``blake3``
package on every core, which is what the recorder does without a GPU), and that each device digest is
the package's. The states are random tensors of the models' shapes (no model is built: the hash
sees bytes). Run by ``scripts/gpu_check.sh``; needs CUDA and Triton (PyTorch's CUDA builds ship it).

    python bench/gpu_tree.py [--gib 1] [--presets 124M,1.2B] [--json out.json]
"""

from __future__ import annotations

import os
import time

import torch
from common import parser, report

# GPT-2's shapes: (layers, width, vocabulary, context)
PRESETS = {"124M": (12, 768, 50257, 1024), "1.2B": (24, 2048, 50257, 1024)}


def gpt2_shapes(layers: int, d: int, vocab: int, ctx: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2 of that size (the head tied to the embedding)."""
    out = [(vocab, d), (ctx, d), (d,), (d,)]
    for _ in range(layers):
        out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 3) -> float:  # noqa: ANN001
    """Best wall time of ``fn`` over ``repeat`` runs, after one warm-up (Triton compiles on the first)."""
    fn()
    _sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--presets", default="124M,1.2B")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script under TRITON_INTERPRET=1")
    args = ap.parse_args()
    import blake3

    from witness.fingerprint import b3gpu

    dev = torch.device(args.device)
    figures: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                     "host_cores": os.cpu_count()}
    buf = torch.randint(0, 256, (int(args.gib * (1 << 30)),), dtype=torch.uint8, device=dev)
    figures["buffer_bytes"] = buf.numel()
    figures["kernel_chunks_gbps"] = buf.numel() / timed(lambda b=buf: b3gpu.chunk_cvs(b)) / 1e9
    figures["kernel_tree_gbps"] = buf.numel() / timed(lambda b=buf: b3gpu.tree(b)) / 1e9
    host = buf.cpu().numpy()
    figures["host_package_gbps"] = host.nbytes / timed(lambda h=host: blake3.blake3(h, max_threads=blake3.blake3.AUTO)
                                                       .digest(), 1) / 1e9
    figures["digest_equal"] = b3gpu.tree(buf)[0] == blake3.blake3(host).digest()
    del host, buf
    for name in filter(None, args.presets.split(",")):
        shapes = gpt2_shapes(*PRESETS[name])
        params = sum(int(torch.Size(s).numel()) for s in shapes)
        state = [torch.randn(s, device=dev) for s in shapes for _ in range(3)]  # parameter, exp_avg, exp_avg_sq
        nbytes = sum(t.numel() * t.element_size() for t in state)
        device_s = timed(lambda st=state: [b3gpu.tensor_tree(t) for t in st], 2)

        def on_host(st=state) -> None:
            for t in st:
                blake3.blake3(t.cpu().numpy(), max_threads=blake3.blake3.AUTO).digest()

        host_s = timed(on_host, 1)
        same = all(b3gpu.tensor_tree(t)[0] == blake3.blake3(t.cpu().numpy()).digest() for t in state[:6])
        figures[name] = {"parameters": params, "state_bytes": nbytes, "device_commit_s": device_s,
                         "device_gbps": nbytes / device_s / 1e9, "host_copy_and_hash_s": host_s,
                         "host_gbps": nbytes / host_s / 1e9, "device_to_host": device_s / host_s,
                         "digests_equal": same}
        del state
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return report(figures, args.json)


if __name__ == "__main__":
    main()
