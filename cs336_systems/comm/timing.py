"""Timing on several ranks: wait for the device before reading the clock, keep the slowest rank.

A GPU runs kernels after the host has queued them, so a host clock read right after queuing
measures the queuing only: :func:`sync_device` waits for every stream first. A data-parallel
step ends when its slowest rank's does, so per-step times are reduced with MAX over the ranks
(:func:`slowest_rank`); every rank gets the same numbers and can take the same decisions.
"""

from __future__ import annotations

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
