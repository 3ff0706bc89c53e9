"""One configuration of the claims benchmark, as stored in ``lightning_claims.json``.

Times are the slowest rank's, one entry per timed step in round order: entry ``i`` of every
configuration of a run was timed in the same round, which the paired ratios rely on. Peak
memory is the device allocator's high-water mark over each fit (CUDA only: a CPU has no
allocator statistics; None there).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record


@dataclass(frozen=True)
class ClaimsRecord(Record):
    """One configuration's timed steps and peak memory."""

    KIND: ClassVar[str] = "lightning_claims"
    VERSION: ClassVar[int] = 1

    config: str  # configs.CONFIGS' name, e.g. "torch+views"
    implementation: str  # "lightning-ddp" or "cs336-bucketed"
    options: dict  # the strategy's keyword arguments
    precision: str  # the Trainer's precision
    step_times_s: list[float]  # slowest rank's time per timed step, in round order
    steps_per_round: int
    peak_memory_bytes: list[int] | None  # per round, the largest rank's peak (CUDA); None on CPU

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    def round_times_s(self) -> list[float]:
        """Per round, the median of its timed steps (what the paired ratios compare)."""
        k = self.steps_per_round
        return [statistics.median(self.step_times_s[i:i + k]) for i in range(0, len(self.step_times_s), k)]
