"""Bucketed overlapped DDP (problem 6): gradients grouped into buckets, each all-reduced when full.

Between per-parameter (many small calls, each paying the fixed cost) and flat (one call that
cannot start before backward ends) lies bucketing: parameters, taken in reverse registration
order (about the order backward finishes them), fill buckets of at most ``bucket_size_mb``;
a bucket's async all-reduce starts as soon as its last gradient is ready. Buckets never mix
dtypes or devices, because one buffer holds one dtype on one device.

Levers beyond the handout, each on by default and each measured on/off by the ablation
benchmark (``scripts/bench_ddp.py --ablation``):

* ``gradient_as_bucket_view``: gradients live in the bucket buffers (no copy back);
* ``first_bucket_mb``: the first bucket to fill is small (torch uses 1 MiB), so that
  communication starts early in backward instead of after a full-size bucket;
* ``reorder_after_first_step``: after the first step, buckets are rebuilt in the order
  gradients actually became ready (see overlap_base.py);
* ``comm_dtype``: communicate gradients in a narrower dtype (off by default: it changes the
  numbers; bfloat16 halves the bytes);
* ``bucket_size_mb="auto"``: the size the overhead model predicts is best for this model on
  this job's measured all-reduce (bucket_autotune.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.bucket_autotune import AllReduceCalibration, auto_bucket_bytes
from cs336_systems.flat_buffer import FlatGradBuffer
from cs336_systems.overlap_base import OverlappedDataParallel, ReductionUnit

MB = 2**20  # bucket sizes are in MiB, as torch DDP's bucket_cap_mb


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


AUTO = "auto"


def check_bucket_size_mb(bucket_size_mb: float | str | None, allow_auto: bool = False) -> float | None:
    """The bucket cap in bytes (inf for None, None for "auto" where allowed); ValueError for
    anything but a positive number."""
    if bucket_size_mb is None:
        return math.inf
    if allow_auto and bucket_size_mb == AUTO:
        return None
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        expected = 'a positive number, None or "auto"' if allow_auto else "a positive number or None"
        raise ValueError(f"bucket_size_mb must be {expected}, got {bucket_size_mb!r}")
    if math.isnan(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
    return float(bucket_size_mb) * MB


class GradBucket(ReductionUnit):
    """A bucket: its flat buffer (storage) and the async work reducing it (handle)."""

    def __init__(
        self, params: list[nn.Parameter], comm_dtype: torch.dtype | None, grad_views: bool
    ):
        self.params = params
        self.buffer = FlatGradBuffer(params, comm_dtype=comm_dtype, grad_views=grad_views)

    def on_param_ready(self, param: nn.Parameter) -> None:
        self.buffer.adopt_grad(param)

    def launch(self, ddp: OverlappedDataParallel) -> dist.Work:
        self.buffer.pack(ddp.world_size)
        return ddp._all_reduce(self.buffer.data, async_op=True)

    def complete(self, world_size: int) -> None:
        self.buffer.unpack(world_size)


class BucketedDDP(OverlappedDataParallel):
    """Bucketed overlapped DDP; call :meth:`finish_gradient_synchronization` before the step.

    ``bucket_size_mb=None`` puts every gradient of a kind into one unbounded bucket;
    ``"auto"`` calibrates the all-reduce at construction and uses the model's optimum.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | str | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        *,
        gradient_as_bucket_view: bool = True,
        first_bucket_mb: float | None = 1.0,
        reorder_after_first_step: bool = True,
        comm_dtype: torch.dtype | None = None,
    ):
        # Validated before the base class broadcasts anything, so a bad call fails alone.
        self.bucket_cap_bytes = check_bucket_size_mb(bucket_size_mb, allow_auto=True)
        self.calibration: AllReduceCalibration | None = None  # set when bucket_size_mb="auto"
        self.first_bucket_cap_bytes = (
            None if first_bucket_mb is None else check_bucket_size_mb(first_bucket_mb)
        )
        if comm_dtype is not None and not (
            isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point
        ):
            raise ValueError(f"comm_dtype must be a floating-point torch.dtype, got {comm_dtype!r}")
        self.bucket_size_mb = bucket_size_mb
        self.comm_dtype = comm_dtype
        # A gradient cannot be a view of a buffer of another dtype.
        self.gradient_as_bucket_view = gradient_as_bucket_view and comm_dtype is None
        super().__init__(module, process_group, reorder_after_first_step)

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
        if self.bucket_cap_bytes is None:  # "auto": every rank runs this at construction
            sizes = [p.numel() * p.element_size() for p in self.synced_params]
            self.bucket_cap_bytes, self.calibration = auto_bucket_bytes(
                sum(sizes), max(sizes), self.synced_params[0].device, self.process_group
            )
        plan = plan_buckets(params_in_launch_order, self.bucket_cap_bytes, self.first_bucket_cap_bytes)
        return [
            GradBucket(
                [params_in_launch_order[i] for i in bucket],
                comm_dtype=self.comm_dtype,
                grad_views=self.gradient_as_bucket_view,
            )
            for bucket in plan
        ]

    def _complete_units(self) -> None:
        for bucket in self._units:
            bucket.complete(self.world_size)

    @property
    def buckets(self) -> list[GradBucket]:
        return list(self._units)
