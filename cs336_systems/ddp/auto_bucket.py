"""``bucket_size_mb="auto"``: measure this job's all-reduce, then pick the bucket size the
overhead model says is best (see overhead_model.py: b* = sqrt(s w o)).

The calibration times a few all-reduces of growing payloads on the job's own process group
and devices. Every rank must choose the same size (bucket layouts must match across ranks),
so each payload's time is the slowest rank's, agreed with an all-reduce(MAX), and every rank
then runs the same arithmetic on the same numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cs336_systems.comm.timing import slowest_rank, sync_device
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth, optimal_bucket_bytes
from cs336_systems.units import KB, MB

# Small enough to cost milliseconds on gloo, large enough that the bandwidth term shows.
CALIBRATION_PAYLOAD_BYTES = (64 * KB, 512 * KB, 4 * MB)
CALIBRATION_ITERS = 5


@dataclass(frozen=True)
class AllReduceCalibration:
    payload_bytes: tuple[int, ...]
    seconds: tuple[float, ...]  # median over iterations of the slowest rank's time
    o_s: float  # fitted per-call overhead
    w_bytes_per_s: float  # fitted bandwidth
    r2: float  # quality of the linear fit


def calibrate_allreduce(device: torch.device, group: dist.ProcessGroup | None = None) -> AllReduceCalibration:
    medians = []
    for nbytes in CALIBRATION_PAYLOAD_BYTES:
        payload = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(payload, group=group)  # warm-up: connection set-up, allocation
        times = []
        for _ in range(CALIBRATION_ITERS):
            sync_device(device)
            start = time.perf_counter()
            dist.all_reduce(payload, group=group)
            sync_device(device)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    seconds = tuple(slowest_rank(medians, device, group))
    try:
        o, w, r2 = fit_latency_bandwidth(CALIBRATION_PAYLOAD_BYTES, seconds)
    except ValueError:  # time did not grow with the payload: noise swamped the signal
        o, w, r2 = 0.0, 0.0, float("nan")
    # Noise can tip a fit of three points into a non-physical region; fall back to the
    # two-point estimates the smallest and largest payloads give.
    if o <= 0 or w <= 0:
        w = (CALIBRATION_PAYLOAD_BYTES[-1] - CALIBRATION_PAYLOAD_BYTES[0]) / max(seconds[-1] - seconds[0], 1e-9)
        o = max(seconds[0] - CALIBRATION_PAYLOAD_BYTES[0] / w, 1e-6)
    return AllReduceCalibration(CALIBRATION_PAYLOAD_BYTES, seconds, o, w, r2)


def auto_bucket_bytes(
    grad_bytes: int, largest_param_bytes: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[float, AllReduceCalibration]:
    """The bucket cap for a model with ``grad_bytes`` of gradients, and the calibration behind it."""
    calibration = calibrate_allreduce(device, group)
    cap = optimal_bucket_bytes(grad_bytes, calibration.w_bytes_per_s, calibration.o_s, largest_param_bytes)
    return cap, calibration
