"""Timing on several ranks: wait for the device before reading the clock, keep the slowest rank.

A GPU runs kernels after the host has queued them, so a host clock read right after queuing
measures the queuing only: :func:`sync_device` waits for every stream first. A data-parallel
step ends when its slowest rank's does, so per-step times are reduced with MAX over the ranks
(:func:`slowest_rank`); every rank gets the same numbers and can take the same decisions.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist


def sync_device(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_compute_stream(device: torch.device) -> None:
    """Wait for the current (compute) stream only, not for NCCL's streams: what is still being
    communicated when compute ends stays outstanding, as it is in a real step."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class BackwardClock:
    """When a backward's own computation ends, before the gradient reduction that DDP (ours and
    torch's) runs as backward ends, where a fast rank waits for a slow one.

    :meth:`watch` hooks the loss; its gradient is the first a backward computes, so the clock's
    end-of-backward callback is queued with autograd's engine before any reduction's, and
    callbacks run in the order they were queued. :attr:`compute_end` is then the
    ``time.perf_counter()`` at which the computation ended (the compute stream waited for).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.compute_end: float | None = None

    def watch(self, loss: torch.Tensor) -> None:
        self.compute_end = None
        if loss.requires_grad:
            loss.register_hook(self._queue_mark)

    def _queue_mark(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._mark)

    def _mark(self) -> None:
        sync_compute_stream(self.device)
        self.compute_end = time.perf_counter()


def small_tensor_device(device: torch.device, backend: str) -> torch.device:
    """Where to put a few numbers for a collective: NCCL reduces only GPU tensors, gloo is
    simplest on CPU ones."""
    return device if backend == "nccl" else torch.device("cpu")


def slowest_rank(
    values: Sequence[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks (the same list on every rank)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return local.tolist()
