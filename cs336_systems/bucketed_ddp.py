"""Bucketed overlapped DDP (problem 6): gradients grouped into buckets, each all-reduced when full.

Between per-parameter (many small calls, each paying the fixed cost) and flat (one call that
cannot start before backward ends) lies bucketing: parameters, taken in reverse registration
order (about the order backward finishes them), fill buckets of at most ``bucket_size_mb``;
a bucket's async all-reduce starts as soon as its last gradient is ready. Buckets never mix
dtypes or devices, because one buffer holds one dtype on one device.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.distributed as dist
from torch import nn

from cs336_systems.flat_buffer import FlatGradBuffer
from cs336_systems.overlap_base import OverlappedDataParallel, ReductionUnit

MB = 2**20  # bucket sizes are in MiB, as torch DDP's bucket_cap_mb


def plan_buckets(params: Sequence[nn.Parameter], cap_bytes: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes`` each, keeping order.

    Each (dtype, device) kind fills its own open bucket; a bucket is closed when the next
    parameter would overflow it, and a parameter larger than the cap gets a bucket alone.
    Buckets are listed in the order they were opened.
    """
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, float]] = {}  # kind -> (index into buckets, bytes)
    for i, param in enumerate(params):
        kind = (param.dtype, param.device)
        size = param.numel() * param.element_size()
        if kind in open_bucket:
            b, used = open_bucket[kind]
            if used + size <= cap_bytes:
                buckets[b].append(i)
                open_bucket[kind] = (b, used + size)
                continue
        buckets.append([i])
        open_bucket[kind] = (len(buckets) - 1, size)
    return buckets


def check_bucket_size_mb(bucket_size_mb: float | None) -> float:
    """The bucket cap in bytes (inf for None); ValueError for anything but a positive number."""
    if bucket_size_mb is None:
        return math.inf
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise ValueError(f"bucket_size_mb must be a positive number or None, got {bucket_size_mb!r}")
    if math.isnan(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
    return float(bucket_size_mb) * MB


class GradBucket(ReductionUnit):
    """A bucket: its flat buffer (storage) and the async work reducing it (handle)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = FlatGradBuffer(params)

    def launch(self, ddp: OverlappedDataParallel) -> dist.Work:
        self.buffer.pack(ddp.world_size)
        return ddp._all_reduce(self.buffer.data, async_op=True)

    def complete(self) -> None:
        self.buffer.unpack()


class BucketedDDP(OverlappedDataParallel):
    """Bucketed overlapped DDP; call :meth:`finish_gradient_synchronization` before the step.

    ``bucket_size_mb=None`` puts every gradient of a kind into one unbounded bucket.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        reorder_after_first_step: bool = True,
    ):
        # Validated before the base class broadcasts anything, so a bad size fails alone.
        self.bucket_cap_bytes = check_bucket_size_mb(bucket_size_mb)
        self.bucket_size_mb = bucket_size_mb
        super().__init__(module, process_group, reorder_after_first_step)

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
        plan = plan_buckets(params_in_launch_order, self.bucket_cap_bytes)
        return [GradBucket([params_in_launch_order[i] for i in bucket]) for bucket in plan]

    def _complete_units(self) -> None:
        for bucket in self._units:
            bucket.complete()

    @property
    def buckets(self) -> list[GradBucket]:
        return list(self._units)
