"""Measurements taken beside the timed steps, which the writeup needs to say *why* a variant costs what it does.

* :class:`CopyProbe`: flat DDP's synchronisation is pack (every gradient copied into one flat
  buffer), one all-reduce, unpack (copied back). Its step time cannot tell the copies from the
  all-reduce, so after each timed flat step the probe times the same two copies on buffers of
  the same class over the same parameter groups as flat's (``GradBucket`` per dtype and
  device group). The copies rewrite the gradients with their own values, so training is
  unchanged; they run outside the timed step, so the step times are unchanged too.
* :func:`comm_dtype_error`: a variant that communicates in a narrower dtype (bfloat16) changes
  the averaged gradients. One extra reduction of the same local gradients, in float32 and in
  that dtype (summed in it, then divided in float32, as ``GradBucket`` does), measures by how
  much.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.comm.coalesced import group_by_dtype_and_device
from cs336_systems.comm.timing import sync_device
from cs336_systems.ddp.bucket import GradBucket, write_reduced_grads


class CopyProbe:
    """Flat DDP's pack and unpack copies, on buffers built as flat builds its own."""

    def __init__(self, params: list[nn.Parameter], world_size: int):
        self.buffers = [GradBucket(group) for group in group_by_dtype_and_device(params)]
        self.world_size = world_size

    def time_copies(self, device: torch.device) -> tuple[float, float]:
        """(seconds to pack every buffer, seconds to unpack them), after a step left its gradients."""
        sync_device(device)
        dist.barrier()  # the ranks copy at the same time, as they do inside flat's step
        start = time.perf_counter()
        for buffer in self.buffers:
            buffer.pack()
        sync_device(device)
        packed = time.perf_counter()
        write_reduced_grads(self.buffers, self.world_size)
        sync_device(device)
        return packed - start, time.perf_counter() - packed


def comm_dtype_error(params: list[nn.Parameter], comm_dtype: torch.dtype) -> float:
    """Relative L2 error of the gradient average communicated in ``comm_dtype`` against float32's.

    Collective: every rank calls it with its local gradients (``.grad`` of ``params``, after a
    backward pass without synchronisation) and gets the same value.
    """
    local = torch.cat([p.grad.reshape(-1).float() for p in params if p.grad is not None])
    world_size = dist.get_world_size()
    exact = local.clone()
    dist.all_reduce(exact)
    exact /= world_size
    narrow = local.to(comm_dtype)
    dist.all_reduce(narrow)
    approx = narrow.float() / world_size
    norm = torch.linalg.vector_norm(exact)
    if norm == 0:
        return 0.0
    return (torch.linalg.vector_norm(approx - exact) / norm).item()
