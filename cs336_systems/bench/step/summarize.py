"""From the slowest rank's step times to the figures reported per variant.

The exposed overhead is paired round by round with the compute-only step (see
:mod:`cs336_systems.bench.stats`): step ``i`` of every variant ran in the same round, so the
per-round difference cancels most of the machine's drift, and its median comes with a
distribution-free 95% interval.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, bucket_size_of


@dataclass(frozen=True)
class RawVariant:
    """What the ranks measured for one variant, reduced to the slowest rank per step."""

    variant: str
    step_times_s: list[float]  # one per timed step, in round order
    sync_times_s: list[float] | None  # None where there is no synchronisation phase
    allreduce_calls_per_step: float | None
    n_buckets: int | None = None
    bucket_cap_bytes: float | None = None
    bucket_bytes: list[int] | None = None
    first_bucket_cap_bytes: float | None = None
    bucket_params: list[list[str]] | None = None
    pack_times_s: list[float] | None = None
    unpack_times_s: list[float] | None = None
    comm_error_rel: float | None = None


def summarize(raw: list[RawVariant], tokens_per_step: int) -> list[StepRecord]:
    """One record per variant, in the order of ``raw``; ValueError without a compute-only variant."""
    floor = next((r for r in raw if r.variant == COMPUTE_ONLY), None)
    if floor is None:
        raise ValueError(f"no {COMPUTE_ONLY!r} variant: exposed overhead is measured against it")
    records = []
    for r in raw:
        steps = sorted(r.step_times_s)
        median_step = statistics.median(steps)
        exposed, interval = paired_median(r.step_times_s, floor.step_times_s)
        records.append(StepRecord(
            variant=r.variant,
            step_times_s=list(r.step_times_s),
            sync_times_s=None if r.sync_times_s is None else list(r.sync_times_s),
            allreduce_calls_per_step=r.allreduce_calls_per_step,
            n_buckets=r.n_buckets,
            bucket_cap_bytes=r.bucket_cap_bytes,
            bucket_size_mb=bucket_size_of(r.variant),
            bucket_bytes=None if r.bucket_bytes is None else list(r.bucket_bytes),
            median_step_s=median_step,
            min_step_s=steps[0],
            max_step_s=steps[-1],
            median_sync_s=statistics.median(r.sync_times_s) if r.sync_times_s else None,
            exposed_overhead_s=exposed,
            exposed_overhead_ci95_s=list(interval) if interval else None,
            exposed_share=exposed / median_step,
            tokens_per_s=tokens_per_step / median_step,
            steps_timed=len(steps),
            first_bucket_cap_bytes=r.first_bucket_cap_bytes,
            bucket_params=None if r.bucket_params is None else [list(names) for names in r.bucket_params],
            pack_times_s=None if r.pack_times_s is None else list(r.pack_times_s),
            unpack_times_s=None if r.unpack_times_s is None else list(r.unpack_times_s),
            comm_error_rel=r.comm_error_rel,
        ))
    return records
