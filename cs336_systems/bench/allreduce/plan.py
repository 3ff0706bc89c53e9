"""What fits: the time budget and the memory guard of the all-reduce benchmark.

The run has a time budget: each group (backend x world size) gets an equal share of what is
left, and what a group leaves unused rolls over to the next. Inside a group, rank 0 predicts a
payload's cost per iteration from the previous payload's, scaled by the payload ratio (an
all-reduce's time is roughly linear in bytes past the latency floor; nccl-tests'
PERFORMANCE.md, "Time"), and :func:`plan_iterations` fits the iterations into what is left. A
payload whose buffers would not fit in memory is skipped (:func:`memory_skip_reason`).

Everything here is arithmetic on numbers handed in, except :func:`available_memory_bytes`,
which asks the system; the callers decide on rank 0 and broadcast, so every rank agrees.
"""

from __future__ import annotations

import math
import os

import torch

from cs336_systems.bench.allreduce.setting import GridPoint
from cs336_systems.units import GB, MB

# Buffers per rank, in payloads: the tensor itself, the backend's staging and scratch space
# (gloo's ring works on chunks of it, NCCL keeps its own buffers), and the correctness check.
BUFFERS_PER_RANK = 3
# Linear extrapolation from a payload that fits in cache underestimates one that does not.
ESTIMATE_SAFETY_FACTOR = 1.5
INITIAL_SPAWN_S_PER_RANK = 2.5  # measured: 2 ranks start in ~5 s on 2 cores (torch import dominates)


def plan_iterations(
    remaining_s: float, iteration_s: float, warmup_iters: int, timed_iters: int, min_timed_iters: int
) -> tuple[int, int] | None:
    """(warm-up, timed) iterations that fit in ``remaining_s``, or None if too few would.

    Asked-for counts when they fit; else warm-up drops to 1 (the first all-reduce of a payload
    pays one-off costs), then timed iterations drop, down to ``min_timed_iters``.
    """
    if iteration_s <= 0 or remaining_s >= iteration_s * (warmup_iters + timed_iters):
        return warmup_iters, timed_iters
    affordable = math.floor(max(remaining_s, 0.0) / iteration_s)
    warmup = min(warmup_iters, 1)
    timed = min(timed_iters, affordable - warmup)
    if timed < min(min_timed_iters, timed_iters):
        return None
    return warmup, timed


def budget_skip_reason(point: GridPoint, iteration_s: float, remaining_s: float, min_timed_iters: int) -> str:
    """Why a payload predicted to take ``iteration_s`` per iteration does not fit in ``remaining_s``."""
    fewest = min(1, point.warmup_iters) + min(min_timed_iters, point.timed_iters)
    return (
        f"budget: {fewest} iterations at ~{iteration_s:.3g} s each (predicted) "
        f"exceed the {max(remaining_s, 0):.1f} s left of this group's share"
    )


NO_TIME_LEFT = "budget: no time left in this group's share of the budget"


def available_memory_bytes(device_type: str, device_index: int = 0) -> int | None:
    """Memory the buffers may come from: free RAM (MemAvailable) on CPU, a GPU's total memory on
    CUDA; None when the system does not say."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(device_index).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def ranks_per_memory(device_type: str, ranks_on_node: int, gpus: int) -> int:
    """How many ranks draw on one memory: all of a node's on CPU, those sharing a GPU on CUDA."""
    if device_type == "cuda":
        return math.ceil(ranks_on_node / max(1, gpus))
    return ranks_on_node


def memory_skip_reason(
    payload_bytes: int, ranks: int, available_bytes: int | None, memory_fraction: float | None
) -> str | None:
    """Why a payload must be skipped for memory, or None if its buffers fit (or no guard is set)."""
    if memory_fraction is None or available_bytes is None:
        return None
    needed = ranks * payload_bytes * BUFFERS_PER_RANK
    allowed = memory_fraction * available_bytes
    if needed <= allowed:
        return None
    return (
        f"memory: {ranks} ranks x {payload_bytes / MB:g} MB x {BUFFERS_PER_RANK} buffers = "
        f"{needed / GB:.1f} GiB > {memory_fraction:g} x {available_bytes / GB:.1f} GiB available"
    )


def screen_group(
    points: list[GridPoint], share_s: float, spawn_s: float, ranks: int, available_bytes: int | None,
    memory_fraction: float | None,
) -> tuple[list[GridPoint], list[tuple[GridPoint, str]]]:
    """Split one group's points into those worth starting its ranks for, and (point, reason) skips.

    ``share_s`` is the group's share of the budget, ``spawn_s`` the predicted time to start its
    ranks, ``ranks`` how many of them draw on one memory of ``available_bytes``.
    """
    if share_s <= spawn_s:
        reason = (f"budget: this group's share, {max(share_s, 0):.1f} s, "
                  f"is less than starting its ranks (~{spawn_s:.1f} s)")
        return [], [(p, reason) for p in points]
    to_run, skipped = [], []
    for point in points:
        reason = memory_skip_reason(point.payload_bytes, ranks, available_bytes, memory_fraction)
        if reason is None:
            to_run.append(point)
        else:
            skipped.append((point, reason))
    return to_run, skipped
