"""Witnessing distributed training: DDP and FSDP2 under torchrun (gloo on CPU, nccl on GPU)."""

from .recorder import DistRecorder, backend_threads, exit_now

__all__ = ["DistRecorder", "backend_threads", "exit_now"]
