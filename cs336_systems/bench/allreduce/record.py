"""One point of the all-reduce benchmark's grid, as stored in ``allreduce.json``.

nccl-tests' definitions (its doc/PERFORMANCE.md): algbw = payload bytes / time; busbw =
algbw x 2(n-1)/n for an all-reduce over n ranks, the rate each link carries, which does not
fall with n for a bandwidth-optimal algorithm. GB/s here is 1e9 bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record
from cs336_systems.units import MB


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

    @property
    def payload_mb(self) -> float:
        return self.payload_bytes / MB

    @property
    def measured(self) -> bool:
        return self.skip_reason is None and self.median_s is not None
