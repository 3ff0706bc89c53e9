"""The all-reduce benchmark's driver: one group of ranks per (backend, world size), within a budget.

Spawned here, each group's ranks start, run every payload that fits and return their records;
points that cannot fit (the group's share of the budget is shorter than starting its ranks, or
the buffers exceed the memory share) are recorded as skipped without starting anything. Under
torchrun or SLURM this process is one rank of the launcher's single group: only that world size
runs, one backend per job, and rank 0 takes every decision inside the group.
"""

from __future__ import annotations

import os
import time

import torch
from tqdm import tqdm

from cs336_systems import cli
from cs336_systems.bench.allreduce.group import GroupLimits, benchmark_group_rank
from cs336_systems.bench.allreduce.plan import (
    INITIAL_SPAWN_S_PER_RANK,
    available_memory_bytes,
    ranks_per_memory,
    screen_group,
)
from cs336_systems.bench.allreduce.record import AllReduceRecord, skipped_record
from cs336_systems.bench.allreduce.setting import AllReduceSetting, GridPoint
from cs336_systems.launch import is_shared_gpu, launched_world_size, ranks_on_this_node, run_ranks
from cs336_systems.units import MB

GROUP_TIMEOUT_S = 300  # one collective may wait this long for a slow peer before the group fails


def _say(verbose: bool, message: str) -> None:
    if verbose:
        tqdm.write(message)


def _screen(points: list[GridPoint], share_s: float, spawn_s_per_rank: float,
            setting: AllReduceSetting) -> tuple[list[GridPoint], list[tuple[GridPoint, str]]]:
    world_size = points[0].world_size
    gpus = torch.cuda.device_count() if setting.device == "cuda" else 0
    return screen_group(
        points, share_s, spawn_s_per_rank * world_size, ranks_per_memory(setting.device, world_size, gpus),
        available_memory_bytes(setting.device), setting.memory_fraction,
    )


def run_allreduce_benchmark(setting: AllReduceSetting, verbose: bool = True) -> list[AllReduceRecord]:
    """Time all-reduce over the grid backends x world sizes x payloads; one record per point, in
    grid order. Every process (every rank under torchrun) returns the same records. ValueError
    for a setting that cannot run, before any process starts."""
    setting.validate()
    under_launcher = launched_world_size() is not None
    world_sizes = setting.group_world_sizes
    if under_launcher and world_sizes[0] not in setting.world_sizes:
        _say(verbose and is_writer_process(), f"note: running the launcher's world size {world_sizes[0]}, "
             f"not {list(setting.world_sizes)}")
    run_deadline = time.time() + setting.budget_s
    spawn_s_per_rank = INITIAL_SPAWN_S_PER_RANK
    groups = [(backend, ws) for backend in setting.backends for ws in world_sizes]
    records: list[AllReduceRecord] = []
    for index, (backend, world_size) in enumerate(groups):
        points = setting.grid(backend, world_size)
        share_s = (run_deadline - time.time()) / (len(groups) - index)
        if under_launcher:
            # Every process decides alone here, so nothing may depend on its clock or free
            # memory: rank 0 takes those decisions inside the group.
            to_run, skipped = points, []
        else:
            to_run, skipped = _screen(points, share_s, spawn_s_per_rank, setting)
        shared_gpu = is_shared_gpu(setting.device, ranks_on_this_node(world_size))
        for point, reason in skipped:
            _say(verbose, f"skip {point.label}: {reason}")
            records.append(skipped_record(point, reason, shared_gpu=shared_gpu))
        if not to_run:
            continue
        # Leave time to tear the group down and exit before the share runs out.
        limits = GroupLimits(time.time() + share_s - (1.0 + 0.2 * world_size), setting.memory_fraction,
                             setting.min_timed_iters)
        group_start = time.time()
        results = run_ranks(
            benchmark_group_rank, world_size, args=(to_run, limits, verbose), backend=backend,
            device_type=setting.device, timeout_s=GROUP_TIMEOUT_S, join_timeout_s=share_s + 2 * GROUP_TIMEOUT_S,
        )
        records.extend(results[0].records)
        spawn_s_per_rank = max(0.5, (time.time() - group_start - results[0].rank_wall_s) / world_size)
    order = {key: i for i, key in enumerate((b, ws, p) for b, ws in groups for p in setting.payloads)}
    return sorted(records, key=lambda r: order[(r.backend, r.world_size, r.payload_bytes)])


def is_writer_process() -> bool:
    """Whether this process reports and writes results: always when it spawned the ranks, only
    rank 0 under a launcher (every rank holds the same records)."""
    return launched_world_size() is None or os.environ.get("RANK") == "0"


def console_table(records: list[AllReduceRecord]) -> str:
    """The records as the script prints them: one row per point, times in ms, bandwidths in GB/s."""
    rows = []
    for r in records:
        head = [r.backend, r.world_size, f"{r.payload_bytes / MB:.4g}"]
        if not r.measured:
            rows.append(head + [0, None, None, None, None, f"skipped: {r.skip_reason}"])
            continue
        check = ("ok" if r.correct else "WRONG") + (" (shared GPU)" if r.shared_gpu else "")
        rows.append(head + [r.timed_iters, f"{r.median_s * 1e3:.3f}", f"{r.p10_s * 1e3:.3f}-{r.p90_s * 1e3:.3f}",
                            f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}", check])
    header = ["backend", "ranks", "MB", "iters", "median ms", "p10-p90 ms", "algbw GB/s", "busbw GB/s", "check"]
    return cli.format_table(header, rows, right=lambda i: 0 < i < len(header) - 1)
