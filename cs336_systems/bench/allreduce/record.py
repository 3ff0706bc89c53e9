"""One point of the all-reduce benchmark's grid, as stored in ``allreduce.json``, and its statistics.

nccl-tests' definitions (its doc/PERFORMANCE.md): algbw = payload bytes / time; busbw =
algbw x 2(n-1)/n for an all-reduce over n ranks, the rate each link carries, which does not
fall with n for a bandwidth-optimal algorithm. GB/s here is 1e9 bytes per second, as nccl-tests
prints it (src/all_reduce.cu divides by 1.0E9).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cs336_systems.bench.allreduce.setting import GridPoint
from cs336_systems.results.schema import Record
from cs336_systems.units import MB

GB_PER_S = 1e9  # bytes per second in one GB/s (nccl-tests' unit)


@dataclass(frozen=True)
class AllReduceRecord(Record):
    """What ran for one (backend, device, world size, payload), and its statistics."""

    KIND: ClassVar[str] = "allreduce"
    VERSION: ClassVar[int] = 1

    backend: str  # "gloo" or "nccl"
    device_type: str  # where the payload lives: "cpu" or "cuda"
    world_size: int  # ranks taking part
    payload_bytes: int  # each rank's tensor (float32)
    shared_gpu: bool  # ranks took turns on fewer GPUs than there are ranks (gloo only)
    requested_warmup_iters: int  # what was asked for
    requested_timed_iters: int
    warmup_iters: int  # what ran (fewer when the budget was short; 0 when skipped)
    timed_iters: int
    skip_reason: str | None  # why nothing ran (budget, memory, GPUs); None when it ran
    correct: bool | None  # every rank's reduced values were right (None: not run)
    times_s: list[float] | None  # slowest rank's time per timed iteration
    median_s: float | None
    min_s: float | None
    max_s: float | None
    p10_s: float | None
    p90_s: float | None
    algbw_gbps: float | None  # at the median time
    busbw_gbps: float | None
    threads_per_rank: int | None = None  # torch's intra-op threads in each rank (None: not run)

    @property
    def payload_mb(self) -> float:
        return self.payload_bytes / MB

    @property
    def measured(self) -> bool:
        return self.skip_reason is None and self.median_s is not None

    def busbw_range_gbps(self) -> tuple[float, float]:
        """busbw at the p90 and at the p10 time: the spread of the bandwidth, low to high."""
        assert self.p10_s is not None and self.p90_s is not None, "not measured"
        to_busbw = self.payload_bytes * bus_bandwidth_factor(self.world_size) / GB_PER_S
        return to_busbw / self.p90_s, to_busbw / self.p10_s


def bus_bandwidth_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each element crosses 2(n-1) links of n (PERFORMANCE.md)."""
    return 2 * (world_size - 1) / world_size


def summarize_times(times_s: list[float], payload_bytes: int, world_size: int) -> dict[str, float]:
    """Median and spread of per-iteration times (percentiles interpolated linearly), and the
    bandwidths at the median."""
    median = statistics.median(times_s)
    p10, p90 = np.percentile(times_s, [10, 90]).tolist()
    algbw = payload_bytes / median / GB_PER_S
    return {
        "median_s": median, "min_s": min(times_s), "max_s": max(times_s), "p10_s": p10, "p90_s": p90,
        "algbw_gbps": algbw, "busbw_gbps": algbw * bus_bandwidth_factor(world_size),
    }


def _asked(point: GridPoint, shared_gpu: bool) -> dict:
    return dict(
        backend=point.backend, device_type=point.device_type, world_size=point.world_size,
        payload_bytes=point.payload_bytes, shared_gpu=shared_gpu,
        requested_warmup_iters=point.warmup_iters, requested_timed_iters=point.timed_iters,
    )


def measured_record(
    point: GridPoint, times_s: list[float], *, warmup_iters: int, correct: bool, shared_gpu: bool,
    threads_per_rank: int | None = None,
) -> AllReduceRecord:
    """The record of a point that ran ``warmup_iters`` then ``len(times_s)`` timed iterations."""
    if not times_s:
        raise ValueError(f"{point.label}: a measured record needs at least one time")
    return AllReduceRecord(
        **_asked(point, shared_gpu), warmup_iters=warmup_iters, timed_iters=len(times_s), skip_reason=None,
        correct=correct, times_s=list(times_s), threads_per_rank=threads_per_rank,
        **summarize_times(times_s, point.payload_bytes, point.world_size),
    )


def skipped_record(point: GridPoint, reason: str, *, shared_gpu: bool) -> AllReduceRecord:
    """The record of a point that did not run, and why."""
    return AllReduceRecord(
        **_asked(point, shared_gpu), warmup_iters=0, timed_iters=0, skip_reason=reason, correct=None,
        times_s=None, median_s=None, min_s=None, max_s=None, p10_s=None, p90_s=None,
        algbw_gbps=None, busbw_gbps=None,
    )
