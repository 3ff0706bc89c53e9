"""A gradient bucket (its storage and async work) and the plan that maps parameters to buckets.

The split follows the two jobs of a bucketed reducer: :class:`GradBucket` owns one flat
buffer, its pending count and the handle of its all-reduce; :func:`plan_buckets` decides which
parameters share a bucket, in launch order. The wrapper (bucketed.py) keeps only the order.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from cs336_systems.ddp.flat_buffer import FlatGradBuffer
from cs336_systems.ddp.mean_all_reduce import MeanAllReduce
from cs336_systems.ddp.overlap import ReductionUnit


def plan_buckets(
    params: Sequence[nn.Parameter], cap_bytes: float, first_cap_bytes: float | None = None
) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes`` each, keeping order.

    Each (dtype, device) kind fills its own open bucket; a bucket is closed when the next
    parameter would overflow it, and a parameter larger than the cap gets a bucket alone. The
    very first bucket is capped at ``first_cap_bytes`` if that is smaller. Buckets are listed
    in the order they were opened.
    """
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, float]] = {}  # kind -> (index into buckets, bytes)
    for i, param in enumerate(params):
        kind = (param.dtype, param.device)
        size = param.numel() * param.element_size()
        if kind in open_bucket:
            b, used = open_bucket[kind]
            cap = min(cap_bytes, first_cap_bytes) if b == 0 and first_cap_bytes else cap_bytes
            if used + size <= cap:
                buckets[b].append(i)
                open_bucket[kind] = (b, used + size)
                continue
        buckets.append([i])
        open_bucket[kind] = (len(buckets) - 1, size)
    return buckets


class GradBucket(ReductionUnit):
    """A bucket: its flat buffer (storage), pending count and the async work reducing it."""

    def __init__(
        self, params: list[nn.Parameter], comm_dtype: torch.dtype | None, grad_views: bool
    ):
        super().__init__(params)
        self.buffer = FlatGradBuffer(params, comm_dtype=comm_dtype, grad_views=grad_views)

    def mark_ready(self, param: nn.Parameter) -> None:
        self.buffer.adopt_grad(param)
        super().mark_ready(param)

    def launch(self, comm: MeanAllReduce) -> None:
        self.buffer.pack()
        reduce = comm.mean if self.buffer.averaged_in_comm else comm.sum
        self.work = reduce(self.buffer.data, async_op=True)
