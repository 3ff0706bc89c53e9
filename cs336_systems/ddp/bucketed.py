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
  gradients actually became ready (see overlap.py);
* ``comm_dtype``: communicate gradients in a narrower dtype (off by default: it changes the
  numbers; bfloat16 halves the bytes);
* ``bucket_size_mb="auto"``: the size the overhead model predicts is best for this model on
  this job's measured all-reduce (auto_bucket.py), decided before any bucket is built.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.ddp.auto_bucket import AllReduceCalibration, auto_bucket_bytes
from cs336_systems.ddp.bucket import GradBucket, plan_buckets
from cs336_systems.ddp.flat_buffer import read_missing_flags
from cs336_systems.ddp.overlap import OverlappedDataParallel, ReductionUnit
from cs336_systems.units import MB

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
        broadcast_buffers: bool = True,
    ):
        # Validated before the base class broadcasts anything, so a bad call fails alone.
        cap_bytes = check_bucket_size_mb(bucket_size_mb, allow_auto=True)
        first_cap_bytes = None if first_bucket_mb is None else check_bucket_size_mb(first_bucket_mb)
        if comm_dtype is not None and not (
            isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point
        ):
            raise ValueError(f"comm_dtype must be a floating-point torch.dtype, got {comm_dtype!r}")
        for name, flag in (("gradient_as_bucket_view", gradient_as_bucket_view),
                           ("reorder_after_first_step", reorder_after_first_step)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        super().__init__(
            module, process_group,
            reorder_after_first_step=reorder_after_first_step, broadcast_buffers=broadcast_buffers,
        )
        self.bucket_size_mb = bucket_size_mb
        self.first_bucket_cap_bytes = first_cap_bytes
        self.comm_dtype = comm_dtype
        # A gradient cannot be a view of a buffer of another dtype.
        self.gradient_as_bucket_view = gradient_as_bucket_view and comm_dtype is None
        self.calibration: AllReduceCalibration | None = None  # set when bucket_size_mb="auto"
        if cap_bytes is None:  # "auto": every rank measures together, then decides alike
            sizes = [p.numel() * p.element_size() for p in self.synced_params]
            cap_bytes, self.calibration = auto_bucket_bytes(
                sum(sizes), max(sizes), self.synced_params[0].device, self.process_group
            )
        self.bucket_cap_bytes: float = cap_bytes
        self._install_units(self._build_units(self._initial_order()))

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
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
        buffers = [bucket.buffer for bucket in self.buckets]
        for buffer, flags in zip(buffers, read_missing_flags(buffers)):
            buffer.unpack(self.world_size, flags)

    @property
    def buckets(self) -> list[GradBucket]:
        return list(self._units)  # type: ignore[arg-type]
