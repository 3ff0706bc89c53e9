"""One variant of the DDP step benchmark, as stored in ``ddp_step.json`` (and ``ddp_step-ablation.json``).

Every time is the slowest rank's (a data-parallel step ends when its slowest rank does), in
seconds, one entry per timed step in round order: entry ``i`` of every variant of a run was
timed in the same round, which is what the paired figures rely on.

The rank that measured a variant builds its record (:meth:`StepRecord.from_steps`), so the
fields below are the only list of what a variant's run yields.

Version 2 adds what the writeup needs to explain the numbers: each bucket's parameters and the
first bucket's cap (why a cap above all gradients still gives two buckets), flat DDP's pack and
unpack copies timed beside its steps (where its synchronisation time goes), and the error of a
narrower communication dtype against float32 on the same gradients.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.variants import bucket_size_of
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
    bucket_size_mb: float | None  # the cap the name asked for (None: not bucketed, or "auto")
    median_step_s: float
    min_step_s: float
    max_step_s: float
    median_sync_s: float | None
    exposed_overhead_s: float  # median over rounds of (this step - the compute-only step)
    exposed_overhead_ci95_s: list[float] | None  # its sign-test interval [low, high]; None: too few rounds
    exposed_share: float  # exposed overhead / median step
    tokens_per_s: float  # tokens of the global batch per median step
    steps_timed: int
    # Measured beside the step times; None where the variant has no such thing.
    allreduce_calls_per_step: float | None = None  # median over steps (torch DDP: its bucket count)
    n_buckets: int | None = None  # buckets built (bucketed variants; torch DDP after its rebuild)
    bucket_cap_bytes: float | None = None  # the cap a bucketed variant used ("auto": the one it chose)
    bucket_bytes: list[int] | None = None  # payload of each bucket as built, in launch order (bucketed variants)
    first_bucket_cap_bytes: float | None = None  # the first bucket's cap (first_bucket_mb); None: lever
    # off or not bucketed
    bucket_params: list[list[str]] | None = None  # names of each bucket's parameters, buckets in launch order
    pack_times_s: list[float] | None = None  # flat: copying every gradient into the flat buffer, timed
    # after each timed step on buffers like flat's (slowest rank); None for other variants
    unpack_times_s: list[float] | None = None  # flat: copying the buffer back into the gradients, likewise
    steps_per_round: int = 1  # timed steps per round: pairing averages each round's (files from before
    # this field paired single steps; the writeup regroups them by their setting, see regrouped())
    comm_error_rel: float | None = None  # a narrower comm dtype: ||average in it - float32 average|| /
    # ||float32 average|| (L2), both from one reduction of the same local gradients

    @classmethod
    def from_steps(cls, variant: str, step_times_s: list[float], compute_only_s: list[float], tokens_per_step: int,
                   sync_times_s: list[float] | None = None, steps_per_round: int = 1, **measured: Any) -> StepRecord:
        """The record of ``variant``'s timed steps, with the figures derived from them.

        ``step_times_s`` and ``compute_only_s`` are the slowest rank's, step ``i`` of both timed in
        the same round: the exposed overhead is their per-round difference, whose median comes
        with a distribution-free 95% interval (bench/stats.py), pairing cancelling most of the
        machine's drift; a round of several steps counts once, by their mean. ``measured``: the
        remaining fields as measured (buckets, copies, errors).
        """
        steps = sorted(step_times_s)
        median_step = statistics.median(steps)
        exposed, interval = paired_median(step_times_s, compute_only_s, steps_per_round=steps_per_round)
        return cls(
            variant=variant,
            step_times_s=list(step_times_s),
            sync_times_s=sync_times_s,
            bucket_size_mb=bucket_size_of(variant),
            median_step_s=median_step,
            min_step_s=steps[0],
            max_step_s=steps[-1],
            median_sync_s=statistics.median(sync_times_s) if sync_times_s else None,
            exposed_overhead_s=exposed,
            exposed_overhead_ci95_s=list(interval) if interval else None,
            exposed_share=exposed / median_step,
            tokens_per_s=tokens_per_step / median_step,
            steps_timed=len(steps),
            steps_per_round=steps_per_round,
            **measured,
        )

    def regrouped(self, steps_per_round: int, compute_only_s: list[float]) -> StepRecord:
        """This record paired by rounds of ``steps_per_round`` steps: a file written before
        ``steps_per_round`` was a field paired every step as if it were a round, which narrows the
        interval of a run with several steps per round (the H100 run: 16 steps in 8 rounds)."""
        if steps_per_round == self.steps_per_round:
            return self
        exposed, interval = paired_median(self.step_times_s, compute_only_s, steps_per_round=steps_per_round)
        return dataclasses.replace(self, steps_per_round=steps_per_round, exposed_overhead_s=exposed,
                                   exposed_overhead_ci95_s=list(interval) if interval else None,
                                   exposed_share=exposed / self.median_step_s)

    @property
    def sync_share(self) -> float | None:
        """Median over timed steps of (time in gradient synchronisation / step time)."""
        if not self.sync_times_s or len(self.sync_times_s) != len(self.step_times_s):
            return None
        return statistics.median(s / t for s, t in zip(self.sync_times_s, self.step_times_s))

    @property
    def is_bucketed(self) -> bool:
        return self.variant.startswith("bucketed-")
