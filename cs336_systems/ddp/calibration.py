"""The all-reduce calibration of ``bucket_size_mb="auto"`` and of the doctor: ``o`` and ``w`` on this job.

:func:`calibrate_allreduce` is the one calibration of the repo: ``AutoBucketedDDP`` runs it with
its defaults when asked for ``"auto"``, and the doctor (``cs336_systems/doctor``) with its own
payloads and iterations. It times a few all-reduces of growing payloads on the job's own
process group and devices, nccl-tests style: every rank starts each iteration together (a
barrier), the clock is read after the device has finished, each iteration's time is the
slowest rank's, and each payload's time is the median over its iterations. It also checks that
every sum came out exact. Every rank gets the same numbers and so takes the same decisions
(bucket layouts must match across ranks).

The fit and its one fallback rule (:func:`fit_calibration`): ``time = o + bytes / w`` is fitted
by relative least squares (overhead_model.fit_latency_bandwidth), and then

* a negative intercept means the per-call cost is below what the timings resolve: ``o = 0``
  (the model then asks for the smallest buckets allowed, one per largest parameter);
* when the time does not grow with the payload there is no slope to fit (noise swamped the
  bandwidth term): ``o`` is the smallest payload's time, all of it fixed cost, and ``w`` the
  largest payload's bytes over its time, the lowest bandwidth the timings allow.

Either way ``o >= 0`` and ``w > 0``, and :attr:`AllReduceCalibration.note` says what was done.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth
from cs336_systems.units import KB, MB

# Small enough to cost milliseconds on gloo, large enough that the bandwidth term shows.
CALIBRATION_PAYLOAD_BYTES = (64 * KB, 512 * KB, 4 * MB)
CALIBRATION_ITERS = 5
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class AllReduceCalibration:
    payload_bytes: tuple[int, ...]
    seconds: tuple[float, ...]  # per payload: median over iterations of the slowest rank's time
    correct: tuple[bool, ...]  # per payload: every rank's every sum was exact
    o_s: float  # per-call overhead, >= 0
    w_bytes_per_s: float  # bandwidth (algbw), > 0
    r2: float | None  # quality of the linear fit; None when there was no fit
    note: str | None = None  # the fallback applied (see the module docstring), if any


def fit_calibration(
    payload_bytes: Sequence[int], seconds: Sequence[float]
) -> tuple[float, float, float | None, str | None]:
    """``(o, w, r2, note)`` from per-payload times, by the fit and fallback rule above. Pure."""
    try:
        o, w, r2 = fit_latency_bandwidth(payload_bytes, seconds)
    except ValueError:
        # Given distinct payloads and times > 0 (as calibrate_allreduce's are), the fit fails
        # only for want of a positive slope.
        by_size = sorted(zip(payload_bytes, seconds))
        (_, o), (largest, largest_s) = by_size[0], by_size[-1]
        w = largest / largest_s
        return o, w, None, (
            "all-reduce time did not grow with the payload, so no bandwidth could be fitted: o is the "
            f"smallest payload's time ({o * 1e6:.1f} us), w the largest payload over its time "
            f"({w / 1e9:.3f} GB/s)"
        )
    if o < 0:
        return 0.0, w, r2, (
            f"fitted per-call cost o = {o * 1e6:.1f} us is below what the timings resolve; taken as 0"
        )
    return o, w, r2, None


def check_calibration(payload_bytes: Sequence[int], iters: int) -> None:
    """ValueError unless :func:`calibrate_allreduce` can run with these payloads and iterations."""
    if len(set(payload_bytes)) < 2 or any(b <= 0 or b % FLOAT32_BYTES for b in payload_bytes):
        raise ValueError(
            f"calibration needs >= 2 distinct payloads, positive multiples of {FLOAT32_BYTES} bytes; "
            f"got {tuple(payload_bytes)}"
        )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"calibration iterations must be an integer >= 1, got {iters!r}")


def calibrate_allreduce(
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    payload_bytes: Sequence[int] = CALIBRATION_PAYLOAD_BYTES,
    iters: int = CALIBRATION_ITERS,
) -> AllReduceCalibration:
    """Time ``iters`` all-reduces of each payload (after one warm-up) and fit ``o`` and ``w``.

    A collective: every rank of ``group`` calls it with the same arguments. Payloads are
    float32, so each must be a positive multiple of 4 bytes; at least two distinct ones.
    Each rank fills its payload with ``rank + 1`` before every iteration (outside the timed
    part), so an exact sum is ``n (n + 1) / 2`` everywhere.
    """
    check_calibration(payload_bytes, iters)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    exact_sum = world_size * (world_size + 1) / 2
    local_times: list[float] = []
    wrong: list[float] = []
    for nbytes in payload_bytes:
        payload = torch.empty(nbytes // FLOAT32_BYTES, dtype=torch.float32, device=device)
        dist.all_reduce(payload.fill_(rank + 1), group=group)  # warm-up: connection set-up, allocation
        exact = True
        for _ in range(iters):
            payload.fill_(rank + 1)
            dist.barrier(group=group)  # every rank starts the iteration together
            sync_device(device)
            start = time.perf_counter()
            dist.all_reduce(payload, group=group)
            sync_device(device)
            local_times.append(time.perf_counter() - start)
            exact = exact and bool(torch.all(payload == exact_sum))
        wrong.append(0.0 if exact else 1.0)
    # One collective for all: each iteration's slowest rank, and whether any rank was wrong.
    values = slowest_rank(local_times + wrong, small_tensor_device(device, dist.get_backend(group)), group)
    times, flags = values[: len(local_times)], values[len(local_times):]
    seconds = tuple(statistics.median(times[i * iters : (i + 1) * iters]) for i in range(len(payload_bytes)))
    o, w, r2, note = fit_calibration(payload_bytes, seconds)
    return AllReduceCalibration(tuple(payload_bytes), seconds, tuple(f == 0.0 for f in flags), o, w, r2, note)
