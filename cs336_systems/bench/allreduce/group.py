"""One group of ranks (one backend and world size) running every payload of the grid, smallest first.

Starting a group costs seconds, so one group runs all its payloads. Rank 0 decides what runs
and for how many iterations (from the time left before the group's deadline and the memory
free) and broadcasts the decision: every rank must call the same collectives, and their clocks
and views of free memory differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from cs336_systems.bench.allreduce.plan import (
    ESTIMATE_SAFETY_FACTOR,
    NO_TIME_LEFT,
    available_memory_bytes,
    budget_skip_reason,
    memory_skip_reason,
    plan_iterations,
    ranks_per_memory,
)
from cs336_systems.bench.allreduce.record import AllReduceRecord, measured_record, skipped_record
from cs336_systems.bench.allreduce.setting import MIN_TIMED_ITERS, GridPoint
from cs336_systems.bench.allreduce.timing import probe_iteration_s, time_payload
from cs336_systems.launch import RankContext


@dataclass(frozen=True)
class GroupLimits:
    """What bounds a group's work (the same on every rank)."""

    deadline_unix_s: float  # wall clock, so that spawned ranks and their parent agree
    memory_fraction: float | None  # share of the memory the buffers may take; None: no guard
    min_timed_iters: int = MIN_TIMED_ITERS  # fewest timed iterations worth running


@dataclass(frozen=True)
class GroupResult:
    """What a rank returns: the records (the same on every rank) and its time in the group."""

    records: list[AllReduceRecord]
    rank_wall_s: float


def _from_rank0(obj: Any) -> Any:
    """Rank 0's value of ``obj`` on every rank: decisions must agree, or collectives mismatch."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _memory_reason(ctx: RankContext, point: GridPoint, limits: GroupLimits) -> str | None:
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    ranks = ranks_per_memory(ctx.device.type, ctx.local_world_size, gpus)
    available = available_memory_bytes(ctx.device.type, ctx.device.index or 0)
    return memory_skip_reason(point.payload_bytes, ranks, available, limits.memory_fraction)


def plan_payload(
    ctx: RankContext, point: GridPoint, previous: tuple[int, float] | None, limits: GroupLimits
) -> tuple[int, int] | str:
    """(warm-up, timed) iterations for this payload, or why it is skipped; rank 0 decides for all.

    ``previous`` is (payload bytes, measured seconds per iteration) of the last payload run; the
    first payload is estimated from one probe iteration instead.
    """
    reason = None
    if ctx.is_main:
        reason = _memory_reason(ctx, point, limits)
        if reason is None and time.time() >= limits.deadline_unix_s:
            reason = NO_TIME_LEFT
    reason = _from_rank0(reason)
    if reason is not None:
        return reason
    if previous is None:
        iteration_s = probe_iteration_s(ctx, point.payload_bytes)
    else:
        iteration_s = previous[1] * point.payload_bytes / previous[0]
    iteration_s *= ESTIMATE_SAFETY_FACTOR
    plan: tuple[int, int] | str | None = None
    if ctx.is_main:
        remaining = limits.deadline_unix_s - time.time()
        plan = plan_iterations(remaining, iteration_s, point.warmup_iters, point.timed_iters, limits.min_timed_iters)
        if plan is None:
            plan = budget_skip_reason(point, iteration_s, remaining, limits.min_timed_iters)
    return _from_rank0(plan)


def benchmark_group_rank(
    ctx: RankContext, points: list[GridPoint], limits: GroupLimits, verbose: bool = True
) -> GroupResult:
    """One rank of a group: every point of ``points`` (one backend and world size), smallest first."""
    start = time.perf_counter()
    threads = ctx.share_cpu_threads() if ctx.device.type == "cpu" else None
    show = verbose and ctx.is_main
    bar = tqdm(sorted(points, key=lambda p: p.payload_bytes), desc=f"{ctx.backend} x{ctx.world_size}",
               unit="payload", disable=not show)
    records = []
    previous: tuple[int, float] | None = None
    for point in bar:
        plan = plan_payload(ctx, point, previous, limits)
        if isinstance(plan, str):
            if show:
                bar.write(f"skip {point.label}: {plan}")
            records.append(skipped_record(point, plan, shared_gpu=ctx.shared_gpu))
            continue
        warmup, timed = plan
        phase_start = time.perf_counter()
        times, correct = time_payload(ctx, point.payload_bytes, warmup, timed)
        previous = (point.payload_bytes, (time.perf_counter() - phase_start) / (warmup + timed))
        record = measured_record(point, times, warmup_iters=warmup, correct=correct, shared_gpu=ctx.shared_gpu,
                                 threads_per_rank=threads)
        records.append(record)
        if show:
            bar.write(f"{point.label}: median {record.median_s * 1e3:.3f} ms over {timed} iterations, "
                      f"busbw {record.busbw_gbps:.3f} GB/s{'' if correct else ', WRONG RESULT'}")
    bar.close()
    return GroupResult(records, time.perf_counter() - start)
