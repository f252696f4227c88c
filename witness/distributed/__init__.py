"""Witnessing distributed training: DDP and FSDP2 under torchrun (gloo on CPU, nccl on GPU)."""

from .recorder import DistRecorder

__all__ = ["DistRecorder"]
