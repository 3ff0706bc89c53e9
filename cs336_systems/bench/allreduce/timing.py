"""Timing one payload's all-reduces on one rank, and checking what they computed.

Following nccl-tests (https://github.com/NVIDIA/nccl-tests):

* the payload is a float32 tensor; each rank fills it with a rank-dependent pattern before every
  iteration (outside the timed region), so every iteration reduces the same values and the result
  can be checked against the sum over ranks, which is known in closed form;
* each timed iteration is: barrier (ranks start together), device sync, clock, all-reduce, device
  sync, clock. An all-reduce is over when its slowest rank is done, so an iteration's time is the
  maximum over ranks, gathered once after the timed loop (a gather inside it would be timed too).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cs336_systems.bench.allreduce.setting import FLOAT32_BYTES
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.launch import RankContext

# Period of the fill pattern: prime, so that no chunk boundary of a ring algorithm lines up with
# it and a chunk reduced into the wrong place shows up as a wrong value.
PATTERN_PERIOD = 251


def fill_pattern(tensor: torch.Tensor, rank: int) -> None:
    """Element i of rank r holds (r + 1) * (1 + i mod P): small integers, exact in float32."""
    row = (rank + 1) * torch.arange(1, PATTERN_PERIOD + 1, dtype=tensor.dtype, device=tensor.device)
    # One period broadcast over whole periods, not an index tensor: an int64 arange over a 1 GB
    # payload would take 2 GB.
    whole = tensor.numel() // PATTERN_PERIOD * PATTERN_PERIOD
    tensor[:whole].view(-1, PATTERN_PERIOD).copy_(row)
    tensor[whole:].copy_(row[: tensor.numel() - whole])


def matches_reduced_pattern(tensor: torch.Tensor, world_size: int) -> bool:
    """Whether ``tensor`` equals the sum over ranks: n(n+1)/2 * (1 + i mod P), exactly."""
    row = world_size * (world_size + 1) // 2 * torch.arange(
        1, PATTERN_PERIOD + 1, dtype=tensor.dtype, device=tensor.device
    )
    whole = tensor.numel() // PATTERN_PERIOD * PATTERN_PERIOD
    body = tensor[:whole].view(-1, PATTERN_PERIOD)
    body_ok = bool(torch.equal(body, row.expand_as(body)))
    return body_ok and bool(torch.equal(tensor[whole:], row[: tensor.numel() - whole]))


def barrier(ctx: RankContext) -> None:
    """Wait for every rank; NCCL's barrier is told this rank's GPU, or it guesses one and warns."""
    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def _payload(ctx: RankContext, payload_bytes: int) -> torch.Tensor:
    return torch.empty(payload_bytes // FLOAT32_BYTES, dtype=torch.float32, device=ctx.device)


def probe_iteration_s(ctx: RankContext, payload_bytes: int) -> float:
    """Slowest rank's time for one untimed iteration (allocate, fill, all-reduce): a first estimate."""
    barrier(ctx)
    start = time.perf_counter()
    tensor = _payload(ctx, payload_bytes)
    fill_pattern(tensor, ctx.rank)
    dist.all_reduce(tensor)
    sync_device(ctx.device)
    elapsed = time.perf_counter() - start
    del tensor
    return slowest_rank([elapsed], small_tensor_device(ctx.device, ctx.backend))[0]


def time_payload(
    ctx: RankContext, payload_bytes: int, warmup_iters: int, timed_iters: int
) -> tuple[list[float], bool]:
    """(slowest rank's seconds per timed iteration, whether every rank's result was right)."""
    tensor = _payload(ctx, payload_bytes)
    local_times: list[float] = []
    correct = True
    total = warmup_iters + timed_iters
    for i in range(total):
        fill_pattern(tensor, ctx.rank)
        barrier(ctx)
        sync_device(ctx.device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        sync_device(ctx.device)
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
    gathered = slowest_rank(local_times + [0.0 if correct else 1.0], small_tensor_device(ctx.device, ctx.backend))
    return gathered[:-1], gathered[-1] == 0.0
