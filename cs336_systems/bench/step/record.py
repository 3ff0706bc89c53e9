"""One variant of the DDP step benchmark, as stored in ``ddp_step.json`` (and ``ddp_step-ablation.json``).

Every time is the slowest rank's (a data-parallel step ends when its slowest rank does), in
seconds, one entry per timed step in round order: entry ``i`` of every variant of a run was
timed in the same round, which is what the paired figures rely on.

Version 2 adds what the writeup needs to explain the numbers: each bucket's parameters and the
first bucket's cap (why a cap above all gradients still gives two buckets), flat DDP's pack and
unpack copies timed beside its steps (where its synchronisation time goes), and the error of a
narrower communication dtype against float32 on the same gradients.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record


@dataclass(frozen=True)
class StepRecord(Record):
    """One variant's steps and the figures derived from them."""

    KIND: ClassVar[str] = "ddp_step"
    VERSION: ClassVar[int] = 2

    variant: str  # "compute-only", "naive", "flat", "per-parameter", "bucketed-<N>MB[-lever]", "torch-ddp"
    step_times_s: list[float]  # slowest rank's time per timed step, in round order
    sync_times_s: list[float] | None  # of each step, the time in gradient synchronisation after
    # backward (None where there is no such phase: compute-only, torch DDP)
    allreduce_calls_per_step: float | None  # median over steps (torch DDP: its bucket count)
    n_buckets: int | None  # buckets built (bucketed variants; torch DDP after its rebuild)
    bucket_cap_bytes: float | None  # the cap a bucketed variant used ("auto": the one it chose)
    bucket_size_mb: float | None  # the cap the name asked for (None: not bucketed, or "auto")
    bucket_bytes: list[int] | None  # payload of each bucket as built, in launch order (bucketed variants)
    median_step_s: float
    min_step_s: float
    max_step_s: float
    median_sync_s: float | None
    exposed_overhead_s: float  # median over rounds of (this step - the compute-only step)
    exposed_overhead_ci95_s: list[float] | None  # its sign-test interval [low, high]; None: too few rounds
    exposed_share: float  # exposed overhead / median step
    tokens_per_s: float  # tokens of the global batch per median step
    steps_timed: int
    first_bucket_cap_bytes: float | None = None  # the first bucket's cap (first_bucket_mb); None: lever
    # off or not bucketed
    bucket_params: list[list[str]] | None = None  # names of each bucket's parameters, buckets in launch order
    pack_times_s: list[float] | None = None  # flat: copying every gradient into the flat buffer, timed
    # after each timed step on buffers like flat's (slowest rank); None for other variants
    unpack_times_s: list[float] | None = None  # flat: copying the buffer back into the gradients, likewise
    comm_error_rel: float | None = None  # a narrower comm dtype: ||average in it - float32 average|| /
    # ||float32 average|| (L2), both from one reduction of the same local gradients

    @property
    def sync_share(self) -> float | None:
        """Median over timed steps of (time in gradient synchronisation / step time)."""
        if not self.sync_times_s or len(self.sync_times_s) != len(self.step_times_s):
            return None
        return statistics.median(s / t for s, t in zip(self.sync_times_s, self.step_times_s))

    @property
    def is_bucketed(self) -> bool:
        return self.variant.startswith("bucketed-")
