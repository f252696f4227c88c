"""Hashing the training state off the training stream.

The state after step t stays put until the optimizer steps again, but the next forward and
backward need not wait for its hash. ``StateSnapshots`` copies the state into buffers allocated
once (pinned host memory for a GPU model, copied on a side CUDA stream so the copy overlaps the
next forward and backward), and hashes the copy in a background thread. The hash of step t is
ready long before the record of step t + 1, which is when the recorder writes step t's record.

On a GPU the main stream waits for the copy only where it must: just before the optimizer's next
step (a step pre-hook), which is the first write to the copied tensors. On the CPU the copy is
a plain memory copy; the hash thread then shares the cores with training, so the saving there
is only where training leaves a core idle.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..bundle.state import state_hash


class StateSnapshots:
    """Copy a state into reusable buffers and hash the copy in a background thread."""

    def __init__(self, optimizer: torch.optim.Optimizer, digest: str):
        self.digest = digest
        self.buffers: dict[str, torch.Tensor] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="witness-state-hash")
        self.stream = None
        self.pending: Future | None = None
        self._hook = None
        self._optimizer = optimizer

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self.buffers[name] = buf
        return buf

    def submit(self, state: dict[str, torch.Tensor], early: frozenset[str] = frozenset(),
               reduce: Callable[[dict[str, torch.Tensor]], Any] | None = None,
               into: dict[str, torch.Tensor] | None = None) -> Future:
        """Start hashing ``state`` as it is now; the caller must have collected the previous hash.

        ``early`` names tensors the next forward may change before the optimizer steps (BatchNorm's
        running statistics): on a GPU they are copied on the training stream, ahead of that forward.
        ``reduce`` turns the copy into the result (default: the state's root). ``into`` gives the
        host buffers to copy into (the online ring's, which keeps the copy) instead of this
        object's own.
        """
        if self.pending is not None and not self.pending.done():
            raise RuntimeError("the previous state's hash was not collected before the buffers are reused")
        buffer = (lambda n, _t: into[n]) if into is not None else self._buffer
        events = []
        if any(t.is_cuda for t in state.values()):
            main = torch.cuda.current_stream()
            if self.stream is None:
                self.stream = torch.cuda.Stream()
                # the optimizer's next step is the first write to the parameters and moments: it
                # waits for their copy, and nothing before it does
                self._hook = self._optimizer.register_step_pre_hook(lambda *_: main.wait_stream(self.stream))
            copies = {n: buffer(n, t).copy_(t.detach(), non_blocking=True)
                      for n, t in state.items() if n in early}
            events.append(torch.cuda.Event())
            events[-1].record(main)
            self.stream.wait_stream(main)  # copy the state as it is now
            with torch.cuda.stream(self.stream):
                copies |= {n: buffer(n, t).copy_(t.detach(), non_blocking=True)
                           for n, t in state.items() if n not in early}
            events.append(torch.cuda.Event())
            events[-1].record(self.stream)
        else:
            copies = {n: buffer(n, t).copy_(t.detach()) for n, t in state.items()}

        def digest() -> bytes:
            for e in events:
                e.synchronize()  # this thread waits for the copies; the training stream does not
            return reduce(copies) if reduce is not None else state_hash(copies, self.digest)

        self.pending = self.pool.submit(digest)
        return self.pending

    def close(self) -> None:
        """Stop the thread (after the last hash) and remove the optimizer hook."""
        self.pool.shutdown(wait=True)
        if self._hook is not None:
            self._hook.remove()
