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
* ``bucket_size_mb="auto"``: the cap is chosen by this job's own first steps (auto_bucket.py):
  the all-reduce is calibrated at construction, the overhead model proposes its cap, half and
  double it, beside the 25 MB default, and each distinct candidate is timed for a few steps;
  the default stays unless a candidate beat it in every round.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.comm.timing import sync_device
from cs336_systems.ddp.auto_bucket import (
    DEFAULT_BUCKET_MB,
    TUNING_ROUNDS,
    AllReduceCalibration,
    BucketTuner,
    TuningResult,
    agree_on_cap,
    candidate_caps,
    model_bucket_bytes,
)
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

    ``bucket_size_mb=None`` puts every gradient of a kind into one unbounded bucket.

    ``"auto"`` calibrates the all-reduce at construction (a collective) and trains its first
    step with the overhead model's cap ``sqrt(s w o)``. After that step it tunes: the distinct
    bucket layouts among the candidates (25 MB, the model's cap, half and double it: 1 to 4)
    are each used for ``TUNING_ROUNDS`` = 4 steps, one per round, and 25 MB's layout is kept
    unless another beat it in every round (steps timed from forward to the end of this method,
    slowest rank; see ``auto_bucket.BucketTuner``). Tuning therefore takes 1 + 4 k synchronised
    steps for k >= 2 distinct layouts, at most 17, and only the first step when every
    candidate builds the same buckets. Only those steps wait
    for the device (to read the clock), and the last one agrees on the choice with one small
    all-reduce; afterwards the step path is the fixed-cap one. Buckets are rebuilt between
    steps, never within one, so training is unchanged (``tests/test_auto_bucket.py``).
    :attr:`tuning` is True while it lasts and :attr:`tuning_result` says what was measured.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | str | None = DEFAULT_BUCKET_MB,
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
        self.model_cap_bytes: float | None = None  # "auto": the overhead model's cap
        self.tuning_result: TuningResult | None = None  # "auto": set when tuning ends
        self._tuner: BucketTuner | None = None
        self._tune_pending = cap_bytes is None  # "auto" before its first step
        self._tuning_start = 0.0
        if cap_bytes is None:  # "auto": every rank measures together, then decides alike
            sizes = [p.numel() * p.element_size() for p in self.synced_params]
            cap_bytes, self.calibration = model_bucket_bytes(
                sum(sizes), max(sizes), self.synced_params[0].device, self.process_group
            )
            self.model_cap_bytes = cap_bytes
        self.bucket_cap_bytes: float = cap_bytes
        self._launch_order: list[nn.Parameter] = []
        self._install_units(self._build_units(self._initial_order()))

    @property
    def tuning(self) -> bool:
        """Whether "auto" is still choosing its cap (its next synchronised step is a tuning one)."""
        return self._tune_pending or self._tuner is not None

    def _plan(self, cap_bytes: float) -> list[list[int]]:
        return plan_buckets(self._launch_order, cap_bytes, self.first_bucket_cap_bytes)

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
        self._launch_order = list(params_in_launch_order)
        plan = self._plan(self.bucket_cap_bytes)
        return [
            GradBucket(
                [params_in_launch_order[i] for i in bucket],
                comm_dtype=self.comm_dtype,
                grad_views=self.gradient_as_bucket_view,
            )
            for bucket in plan
        ]

    def _use_cap(self, cap_bytes: float) -> None:
        """Rebuild the buckets with ``cap_bytes`` in the current launch order (between steps)."""
        if cap_bytes != self.bucket_cap_bytes:
            self.bucket_cap_bytes = cap_bytes
            self._install_units(self._build_units(self._launch_order))

    def _before_forward(self) -> None:
        super()._before_forward()
        if self.tuning:
            sync_device(self.synced_params[0].device)  # tuning only: the clock starts on an idle device
            self._tuning_start = time.perf_counter()

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        super().finish_gradient_synchronization()
        if self.tuning:
            self._tuning_step_done()

    def _tuning_step_done(self) -> None:
        """After a synchronised step of "auto": record its time, then set up the next step's buckets."""
        sync_device(self.synced_params[0].device)
        elapsed = time.perf_counter() - self._tuning_start
        if self._tune_pending:  # the first step: the launch order is settled now, the layouts known
            self._tune_pending = False
            s = sum(p.numel() * p.element_size() for p in self.synced_params)
            distinct: dict[tuple, float] = {}
            for cap in candidate_caps(self.model_cap_bytes, s):  # type: ignore[arg-type]
                distinct.setdefault(tuple(map(tuple, self._plan(cap))), cap)
            caps = list(distinct.values())
            if len(caps) == 1:
                self.tuning_result = TuningResult((caps[0],), (math.nan,), caps[0])
                self._use_cap(caps[0])
                return
            self._tuner = BucketTuner(caps, TUNING_ROUNDS)
        else:
            assert self._tuner is not None
            self._tuner.record(elapsed)
        tuner = self._tuner
        if tuner.done:
            self.tuning_result = agree_on_cap(tuner, self.synced_params[0].device, self.process_group)
            self._tuner = None
            self._use_cap(self.tuning_result.chosen_cap)
        else:
            self._use_cap(tuner.current_cap)

    def _complete_units(self) -> None:
        buffers = [bucket.buffer for bucket in self.buckets]
        for buffer, flags in zip(buffers, read_missing_flags(buffers)):
            buffer.unpack(self.world_size, flags)

    @property
    def buckets(self) -> list[GradBucket]:
        return list(self._units)  # type: ignore[arg-type]
