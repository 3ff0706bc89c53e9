"""The all-reduce benchmark (problem 1): time of one ``dist.all_reduce`` by backend, world size and payload.

Measurement, following nccl-tests (https://github.com/NVIDIA/nccl-tests):

* the payload is a float32 tensor; each rank fills it with a rank-dependent pattern before every
  iteration (outside the timed region), so every iteration reduces the same values and the result
  can be checked against the sum over ranks, which is known in closed form;
* each timed iteration is: barrier (ranks start together), device sync, clock, all-reduce, device
  sync, clock. An all-reduce is over when its slowest rank is done, so an iteration's time is the
  maximum over ranks, gathered once after the timed loop (a gather inside it would be timed too);
* per setting we report the median, min, max, 10th and 90th percentiles of those times, and the
  bandwidths of nccl-tests' doc/PERFORMANCE.md: algbw = bytes / time, and for all-reduce
  busbw = algbw * 2(n-1)/n, which is comparable with a link's peak whatever the world size.
  GB/s means 1e9 bytes per second, as nccl-tests prints it (src/all_reduce.cu divides by 1.0E9);
  payload sizes in MB are 2**20 bytes.

Scheduling: one process group per (backend, world size) runs all its payloads, smallest first,
because starting a group costs seconds. The run has a time budget: each group gets an equal share
of what is left (what a group leaves unused rolls over to the next), and inside a group rank 0
predicts each payload's cost from the previous payload's measured cost per iteration, scaled by
the payload ratio (an all-reduce's time is roughly linear in bytes once past the latency floor;
PERFORMANCE.md, "Time"). A payload that does not fit runs fewer timed iterations, or is skipped
with a reason, as is one whose buffers would not fit in memory.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from cs336_systems.launch import RankContext, run_ranks, running_under_launcher

MB = 2**20  # bytes; the repo's "MB", as in torch DDP's bucket_cap_mb
GB_PER_S = 1e9  # bytes per second in one GB/s (nccl-tests' unit)
FLOAT32_BYTES = 4
BACKENDS = ("gloo", "nccl")
DEFAULT_WARMUP_ITERS = 5  # nccl-tests defaults: -w 5 warm-up iterations ...
DEFAULT_TIMED_ITERS = 20  # ... and -n 20 timed ones
MIN_TIMED_ITERS = 3  # fewest timed iterations worth a median; below this a payload is skipped
DEFAULT_MEMORY_FRACTION = 0.5  # share of free RAM (or of a GPU's memory) the buffers may take
# Buffers per rank, in payloads: the tensor itself, the backend's staging and scratch space
# (gloo's ring works on chunks of it, NCCL keeps its own buffers), and the correctness check.
BUFFERS_PER_RANK = 3
# Linear extrapolation from a payload that fits in cache underestimates one that does not.
ESTIMATE_SAFETY_FACTOR = 1.5
# Period of the fill pattern: prime, so that no chunk boundary of a ring algorithm lines up with
# it and a chunk reduced into the wrong place shows up as a wrong value.
_PATTERN_PERIOD = 251
_INITIAL_SPAWN_S_PER_RANK = 2.5  # measured: 2 ranks start in ~5 s here (torch import dominates)


@dataclass(frozen=True)
class AllReduceSetting:
    """One point of the benchmark grid."""

    backend: str  # "gloo" or "nccl"
    device_type: str  # where the payload lives: "cpu" or "cuda"
    world_size: int  # ranks taking part in the all-reduce
    payload_bytes: int  # size of each rank's tensor (float32, so a multiple of 4)
    warmup_iters: int  # untimed all-reduces before timing starts
    timed_iters: int  # timed all-reduces (may be lowered to fit the time budget)


# ---------------------------------------------------------------------------------------------
# Statistics


def bus_bandwidth_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each element crosses 2(n-1) links of n (PERFORMANCE.md)."""
    return 2 * (world_size - 1) / world_size


def summarize_times(times_s: list[float], payload_bytes: int, world_size: int) -> dict[str, float]:
    """Median and spread of per-iteration times, and the bandwidths at the median."""
    median = statistics.median(times_s)
    p10, p90 = np.percentile(times_s, [10, 90]).tolist()
    algbw = payload_bytes / median / GB_PER_S
    return {
        "median_s": median,
        "min_s": min(times_s),
        "max_s": max(times_s),
        "p10_s": p10,
        "p90_s": p90,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_bandwidth_factor(world_size),
    }


_STAT_KEYS = ("median_s", "min_s", "max_s", "p10_s", "p90_s", "algbw_gbps", "busbw_gbps")


def make_record(
    setting: AllReduceSetting,
    *,
    shared_gpu: bool,
    times_s: list[float] | None = None,
    warmup_iters: int = 0,
    correct: bool | None = None,
    skip_reason: str | None = None,
) -> dict[str, Any]:
    """One results record: the setting as asked, what ran, and the statistics (None if skipped).

    ``requested_warmup_iters``/``requested_timed_iters`` are what was asked for;
    ``warmup_iters``/``timed_iters`` what ran (fewer when the budget was short, 0 when skipped).
    """
    record: dict[str, Any] = asdict(setting)
    record["requested_warmup_iters"] = record.pop("warmup_iters")
    record["requested_timed_iters"] = record.pop("timed_iters")
    record.update(
        payload_mb=setting.payload_bytes / MB,
        shared_gpu=shared_gpu,
        skipped=skip_reason is not None,
        reason=skip_reason,
        warmup_iters=warmup_iters if times_s else 0,
        timed_iters=len(times_s) if times_s else 0,
        correct=correct,
        times_s=times_s,
    )
    if times_s:
        record.update(summarize_times(times_s, setting.payload_bytes, setting.world_size))
    else:
        record.update(dict.fromkeys(_STAT_KEYS))
    return record


# ---------------------------------------------------------------------------------------------
# Budget and memory guards (pure: rank 0 decides, the others follow)


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


def available_memory_bytes(device_type: str, device: torch.device | None = None) -> int | None:
    """Memory the buffers may come from: free RAM (MemAvailable) on CPU, total memory of a GPU."""
    if device_type == "cuda":
        index = device.index if device is not None and device.index is not None else 0
        return torch.cuda.get_device_properties(index).total_memory
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


def ranks_per_memory(device_type: str, ranks_on_node: int) -> int:
    """How many ranks draw on one memory: all of a node's on CPU, those sharing a GPU on CUDA."""
    if device_type == "cuda":
        return math.ceil(ranks_on_node / max(1, torch.cuda.device_count()))
    return ranks_on_node


def memory_skip_reason(
    payload_bytes: int, ranks: int, available_bytes: int | None, memory_fraction: float | None
) -> str | None:
    """Why a payload must be skipped for memory, or None if its buffers fit."""
    if memory_fraction is None or available_bytes is None:
        return None
    needed = ranks * payload_bytes * BUFFERS_PER_RANK
    allowed = memory_fraction * available_bytes
    if needed <= allowed:
        return None
    return (
        f"memory: {ranks} ranks x {payload_bytes / MB:g} MB x {BUFFERS_PER_RANK} buffers = "
        f"{needed / 2**30:.1f} GiB > {memory_fraction:g} x {available_bytes / 2**30:.1f} GiB available"
    )


def is_shared_gpu(device_type: str, ranks_on_node: int) -> bool:
    """True when ranks outnumber this node's GPUs, so some share one (gloo only)."""
    return device_type == "cuda" and ranks_on_node > torch.cuda.device_count()


# ---------------------------------------------------------------------------------------------
# The payload and its check


def fill_pattern(tensor: torch.Tensor, rank: int) -> None:
    """Element i of rank r holds (r + 1) * (1 + i mod P): small integers, exact in float32."""
    row = (rank + 1) * torch.arange(1, _PATTERN_PERIOD + 1, dtype=tensor.dtype, device=tensor.device)
    _write_periodic(tensor, row)


def _write_periodic(tensor: torch.Tensor, row: torch.Tensor) -> None:
    # Broadcast one period over whole periods instead of materialising an index tensor (an int64
    # arange over a 1 GB payload would take 2 GB).
    period = row.numel()
    whole = tensor.numel() // period * period
    tensor[:whole].view(-1, period).copy_(row)
    tensor[whole:].copy_(row[: tensor.numel() - whole])


def matches_reduced_pattern(tensor: torch.Tensor, world_size: int) -> bool:
    """Whether ``tensor`` equals the sum over ranks: n(n+1)/2 * (1 + i mod P), exactly."""
    row = world_size * (world_size + 1) // 2 * torch.arange(
        1, _PATTERN_PERIOD + 1, dtype=tensor.dtype, device=tensor.device
    )
    whole = tensor.numel() // _PATTERN_PERIOD * _PATTERN_PERIOD
    body = tensor[:whole].view(-1, _PATTERN_PERIOD)
    body_ok = bool(torch.equal(body, row.expand_as(body)))
    return body_ok and bool(torch.equal(tensor[whole:], row[: tensor.numel() - whole]))


# ---------------------------------------------------------------------------------------------
# What each rank runs


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(ctx: RankContext) -> None:
    # NCCL's barrier needs to know this rank's GPU, or it guesses one and warns.
    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def _small_tensor_device(ctx: RankContext) -> torch.device:
    # NCCL only reduces GPU tensors; gloo is simplest and safest on CPU ones.
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _from_rank0(obj: Any) -> Any:
    """Rank 0's value of ``obj`` on every rank: decisions must agree, or collectives mismatch."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _probe_iteration_s(ctx: RankContext, payload_bytes: int) -> float:
    """Slowest rank's time for one untimed iteration (allocate, fill, all-reduce): a first estimate."""
    _barrier(ctx)
    start = time.perf_counter()
    tensor = torch.empty(payload_bytes // FLOAT32_BYTES, dtype=torch.float32, device=ctx.device)
    fill_pattern(tensor, ctx.rank)
    dist.all_reduce(tensor)
    _sync_device(ctx.device)
    elapsed = torch.tensor(
        [time.perf_counter() - start], dtype=torch.float64, device=_small_tensor_device(ctx)
    )
    del tensor
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def time_payload(
    ctx: RankContext, payload_bytes: int, warmup_iters: int, timed_iters: int
) -> tuple[list[float], bool]:
    """(slowest rank's seconds per timed iteration, whether every rank's result was right)."""
    tensor = torch.empty(payload_bytes // FLOAT32_BYTES, dtype=torch.float32, device=ctx.device)
    local_times: list[float] = []
    correct = True
    total = warmup_iters + timed_iters
    for i in range(total):
        fill_pattern(tensor, ctx.rank)
        _barrier(ctx)
        _sync_device(ctx.device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _sync_device(ctx.device)
        elapsed = time.perf_counter() - start
        if i >= warmup_iters:
            local_times.append(elapsed)
        # Checking every result would cost a pass over the payload per iteration; the first and
        # last timed ones catch both a wrong algorithm and state that goes bad with reuse.
        if i in (warmup_iters, total - 1):
            correct = correct and matches_reduced_pattern(tensor, ctx.world_size)
    del tensor
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # give the next (larger) payload the memory back
    # One collective for both: the max over ranks of each time, and of "this rank was wrong".
    gathered = torch.tensor(
        local_times + [0.0 if correct else 1.0], dtype=torch.float64, device=_small_tensor_device(ctx)
    )
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    values = gathered.tolist()
    return values[:-1], values[-1] == 0.0


@dataclass(frozen=True)
class _GroupLimits:
    """What bounds a group's work (the same on every rank)."""

    deadline_unix_s: float  # wall clock, so that spawned ranks and their parent agree
    ranks_on_node: int  # ranks drawing on this node's memory
    memory_fraction: float | None  # see DEFAULT_MEMORY_FRACTION; None: no memory guard
    min_timed_iters: int  # fewest timed iterations worth running


def _plan_payload(
    ctx: RankContext, setting: AllReduceSetting, previous: tuple[int, float] | None, limits: _GroupLimits
) -> tuple[int, int] | str:
    """(warm-up, timed) iterations for this payload, or why it is skipped; rank 0 decides for all.

    ``previous`` is (payload bytes, measured seconds per iteration) of the last payload run; the
    first payload is estimated from one probe iteration instead.
    """
    reason = None
    if ctx.is_main:
        reason = memory_skip_reason(
            setting.payload_bytes,
            ranks_per_memory(ctx.device.type, limits.ranks_on_node),
            available_memory_bytes(ctx.device.type, ctx.device),
            limits.memory_fraction,
        )
        if reason is None and time.time() >= limits.deadline_unix_s:
            reason = "budget: no time left in this group's share of the budget"
    reason = _from_rank0(reason)
    if reason is not None:
        return reason
    if previous is None:
        iteration_s = _probe_iteration_s(ctx, setting.payload_bytes)
    else:
        iteration_s = previous[1] * setting.payload_bytes / previous[0]
    iteration_s *= ESTIMATE_SAFETY_FACTOR
    plan: tuple[int, int] | str | None = None
    if ctx.is_main:
        remaining = limits.deadline_unix_s - time.time()
        plan = plan_iterations(
            remaining, iteration_s, setting.warmup_iters, setting.timed_iters, limits.min_timed_iters
        )
        if plan is None:
            fewest = min(1, setting.warmup_iters) + min(limits.min_timed_iters, setting.timed_iters)
            plan = (
                f"budget: {fewest} iterations at ~{iteration_s:.3g} s each (predicted) "
                f"exceed the {max(remaining, 0):.1f} s left of this group's share"
            )
    return _from_rank0(plan)


def benchmark_group_rank(
    ctx: RankContext,
    settings: list[AllReduceSetting],
    deadline_unix_s: float,
    memory_fraction: float | None = DEFAULT_MEMORY_FRACTION,
    min_timed_iters: int = MIN_TIMED_ITERS,
    verbose: bool = True,
) -> dict[str, Any]:
    """One rank of a group: every payload of ``settings`` (one backend and world size), smallest first.

    Rank 0 decides what runs, and for how many iterations, from the time left before
    ``deadline_unix_s`` (wall clock), and broadcasts it. Returns ``{"records": [...],
    "rank_wall_s": seconds spent in this function}``; the records are the same on every rank.
    """
    start = time.perf_counter()
    ctx.share_cpu_threads()
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    limits = _GroupLimits(deadline_unix_s, ranks_on_node, memory_fraction, min_timed_iters)
    shared_gpu = is_shared_gpu(ctx.device.type, ranks_on_node)
    show = verbose and ctx.is_main
    bar = tqdm(
        sorted(settings, key=lambda s: s.payload_bytes),
        desc=f"{ctx.backend} x{ctx.world_size}",
        unit="payload",
        disable=not show,
    )
    records = []
    previous: tuple[int, float] | None = None
    for setting in bar:
        label = f"{setting.backend} x{setting.world_size} {setting.payload_bytes / MB:g} MB"
        plan = _plan_payload(ctx, setting, previous, limits)
        if isinstance(plan, str):
            if show:
                bar.write(f"skip {label}: {plan}")
            records.append(make_record(setting, shared_gpu=shared_gpu, skip_reason=plan))
            continue
        warmup, timed = plan
        phase_start = time.perf_counter()
        times, correct = time_payload(ctx, setting.payload_bytes, warmup, timed)
        previous = (setting.payload_bytes, (time.perf_counter() - phase_start) / (warmup + timed))
        record = make_record(
            setting, shared_gpu=shared_gpu, times_s=times, warmup_iters=warmup, correct=correct
        )
        records.append(record)
        if show:
            bar.write(
                f"{label}: median {record['median_s'] * 1e3:.3f} ms over {timed} iterations, "
                f"busbw {record['busbw_gbps']:.3f} GB/s{'' if correct else ', WRONG RESULT'}"
            )
    bar.close()
    return {"records": records, "rank_wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# The driver


def _validate(
    backends: list[str],
    world_sizes: list[int],
    payload_bytes_list: list[int],
    warmup: int,
    iters: int,
    budget_s: float,
    device_type: str,
    memory_fraction: float | None,
    min_timed_iters: int,
) -> None:
    if not backends:
        raise ValueError("no backend given: pass at least one of 'gloo', 'nccl'")
    for backend in backends:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if "nccl" in backends and device_type != "cuda":
        raise ValueError(f"the nccl backend reduces GPU tensors only; device_type is {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device_type 'cuda' was asked for, but torch.cuda.is_available() is False")
    if not world_sizes or any(ws < 2 for ws in world_sizes):
        raise ValueError(
            f"world sizes must be >= 2 (an all-reduce over one rank moves nothing), got {world_sizes}"
        )
    if not payload_bytes_list:
        raise ValueError("no payload sizes given")
    for size in payload_bytes_list:
        if size <= 0 or size % FLOAT32_BYTES:
            raise ValueError(
                f"payload_bytes must be a positive multiple of {FLOAT32_BYTES} (float32), got {size}"
            )
    if warmup < 0 or iters < 1 or min_timed_iters < 1:
        raise ValueError(
            f"need warmup >= 0, iters >= 1 and min_timed_iters >= 1; "
            f"got {warmup}, {iters} and {min_timed_iters}"
        )
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    if memory_fraction is not None and not memory_fraction > 0:
        raise ValueError(f"memory_fraction must be > 0 (or None for no memory guard), got {memory_fraction}")


def _say(verbose: bool, message: str) -> None:
    if verbose:
        tqdm.write(message)


def run_allreduce_benchmark(
    backends: Iterable[str],
    world_sizes: Iterable[int],
    payload_bytes_list: Iterable[int],
    warmup: int = DEFAULT_WARMUP_ITERS,
    iters: int = DEFAULT_TIMED_ITERS,
    budget_s: float = 300.0,
    device_type: str = "cpu",
    *,
    memory_fraction: float | None = DEFAULT_MEMORY_FRACTION,
    min_timed_iters: int = MIN_TIMED_ITERS,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Time all-reduce over the grid backends x world sizes x payloads; one record per point.

    Spawns one process group per (backend, world size). Under torchrun (or our SLURM submitter)
    this process is one rank of the launcher's group instead: only its world size runs, and only
    one backend per job. Every process returns the same records. Raises ValueError for bad
    arguments before any process starts.
    """
    backends, world_sizes = list(dict.fromkeys(backends)), list(dict.fromkeys(world_sizes))
    payloads = sorted(set(payload_bytes_list))
    _validate(
        backends, world_sizes, payloads, warmup, iters, budget_s, device_type,
        memory_fraction, min_timed_iters,
    )
    under_launcher = running_under_launcher()
    if under_launcher:
        # The launcher made the one process group this job can have.
        if len(backends) > 1:
            raise ValueError(f"under torchrun, run one backend per job, got {backends}")
        launched = int(os.environ["WORLD_SIZE"])
        if launched not in world_sizes:
            _say(
                verbose and os.environ["RANK"] == "0",
                f"note: running torchrun's world size {launched}, not {world_sizes}",
            )
        world_sizes = [launched]

    run_deadline = time.time() + budget_s
    spawn_s_per_rank = _INITIAL_SPAWN_S_PER_RANK
    groups = [(backend, ws) for backend in backends for ws in world_sizes]
    records: list[dict[str, Any]] = []
    for index, (backend, world_size) in enumerate(groups):
        settings = [AllReduceSetting(backend, device_type, world_size, p, warmup, iters) for p in payloads]
        share_s = (run_deadline - time.time()) / (len(groups) - index)
        if under_launcher:
            # Every process decides alone here, so nothing may depend on its clock or free memory:
            # rank 0 makes those calls inside the group.
            to_run, skipped = settings, []
        else:
            to_run, skipped = _screen_before_spawn(settings, share_s, spawn_s_per_rank, memory_fraction)
        shared_gpu = is_shared_gpu(device_type, world_size)
        for setting, reason in skipped:
            _say(verbose, f"skip {backend} x{world_size} {setting.payload_bytes / MB:g} MB: {reason}")
        records.extend(make_record(s, shared_gpu=shared_gpu, skip_reason=r) for s, r in skipped)
        if not to_run:
            continue
        # Leave time to tear the group down and exit before the share runs out.
        group_deadline = time.time() + share_s - (1.0 + 0.2 * world_size)
        group_start = time.time()
        results = run_ranks(
            benchmark_group_rank,
            world_size,
            args=(to_run, group_deadline, memory_fraction, min_timed_iters, verbose),
            backend=backend,
            device_type=device_type,
            timeout_s=300,
            join_timeout_s=share_s + 600,
        )
        out = results[0]
        records.extend(out["records"])
        overhead_s = time.time() - group_start - out["rank_wall_s"]
        spawn_s_per_rank = max(0.5, overhead_s / world_size)
    # Grid order (backend, world size, payload), whatever was skipped before or inside a group.
    position = {key: i for i, key in enumerate((b, ws, p) for b, ws in groups for p in payloads)}
    records.sort(key=lambda r: position[(r["backend"], r["world_size"], r["payload_bytes"])])
    return records


def _screen_before_spawn(
    settings: list[AllReduceSetting], share_s: float, spawn_s_per_rank: float, memory_fraction: float | None
) -> tuple[list[AllReduceSetting], list[tuple[AllReduceSetting, str]]]:
    """Split a group's settings into those worth spawning for and (setting, reason) skips."""
    first = settings[0]
    if first.backend == "nccl" and first.world_size > torch.cuda.device_count():
        reason = (
            f"nccl needs one GPU per rank: world size {first.world_size} > "
            f"{torch.cuda.device_count()} GPUs (use gloo to share GPUs)"
        )
        return [], [(s, reason) for s in settings]
    spawn_s = spawn_s_per_rank * first.world_size
    if share_s <= spawn_s:
        reason = (
            f"budget: this group's share, {max(share_s, 0):.1f} s, "
            f"is less than starting its ranks (~{spawn_s:.1f} s)"
        )
        return [], [(s, reason) for s in settings]
    available = available_memory_bytes(first.device_type)
    ranks = ranks_per_memory(first.device_type, first.world_size)
    to_run, skipped = [], []
    for setting in settings:
        reason = memory_skip_reason(setting.payload_bytes, ranks, available, memory_fraction)
        if reason is None:
            to_run.append(setting)
        else:
            skipped.append((setting, reason))
    return to_run, skipped
