"""Numbers derived from DDP step records: which runs, variants, the bucket sweep, the model's predictions.

The lever ablation (``ddp_step-ablation.json``) has its own page; every other ``ddp_step*`` run
is read by the step benchmark's page (ddp_sections.py).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, bucketed_name
from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.bench.allreduce.setting import FLOAT32_BYTES  # the benchmarks train in float32
from cs336_systems.ddp.overhead_model import (FitIntervals, exposed_overhead, minimum_exposed_overhead,
                                              optimal_bucket_bytes, optimal_bucket_count, predicted_wait)
from cs336_systems.writeup.allreduce_analysis import CommGroup, LinkFit, comm_groups, fit_group
from cs336_systems.writeup.step_setting import parameter_shapes
from cs336_systems.writeup.load import MachineResults, ResultsFile, WriteupInputs

STEP_KIND = StepRecord.KIND
ABLATION_RUN = f"{STEP_KIND}-ablation"  # the results file (stem) of the lever ablation


def _in_rounds(results: ResultsFile) -> ResultsFile:
    """A step run whose records pair by its setting's rounds (StepRecord.regrouped)."""
    k = results.setting.get("steps_per_round") or 1
    floor = next((r for r in results.records if r.variant == COMPUTE_ONLY), None)
    if floor is None or all(r.steps_per_round == k for r in results.records):
        return results
    return dataclasses.replace(results, records=[r.regrouped(k, floor.step_times_s) for r in results.records])


def step_runs(inputs: WriteupInputs) -> list[tuple[MachineResults, ResultsFile]]:
    """Every DDP step run but the lever ablation, machines in tag order."""
    return [(m, _in_rounds(f)) for m, f in inputs.runs(STEP_KIND) if f.name != ABLATION_RUN]


def ablation_runs(inputs: WriteupInputs) -> list[tuple[MachineResults, ResultsFile]]:
    """The lever ablation of each machine that ran it."""
    return [(m, _in_rounds(f)) for m, f in inputs.runs(STEP_KIND) if f.name == ABLATION_RUN]


def by_variant(records: list[StepRecord]) -> dict[str, StepRecord]:
    return {r.variant: r for r in records}


@dataclass(frozen=True)
class CoreTime:
    """What per-parameter DDP's overlapped all-reduces cost backward: per round, its (step - wait
    after backward) minus naive DDP's, whose all-reduces run only after backward."""

    median_s: float
    ci95_s: tuple[float, float] | None  # sign-test interval of the median over rounds
    rounds: int

    @property
    def slows_backward(self) -> bool:
        """The interval lies above zero: overlapping the all-reduces made the compute slower."""
        return self.ci95_s is not None and self.ci95_s[0] > 0


def core_time_taken(records: list[StepRecord], steps_per_round: int = 1) -> CoreTime | None:
    """:class:`CoreTime` from one run's records; None without both variants' synchronisation times."""
    v = by_variant(records)
    pp, naive = v.get("per-parameter"), v.get("naive")
    if not (pp and naive and pp.sync_times_s and naive.sync_times_s):
        return None
    compute = [[t - s for t, s in zip(r.step_times_s, r.sync_times_s)] for r in (pp, naive)]
    median, interval = paired_median(*compute, steps_per_round=steps_per_round)
    return CoreTime(median, interval, len(compute[0]) // steps_per_round)


def run_fit(machine: MachineResults, results: ResultsFile) -> LinkFit | str | None:
    """The all-reduce line (o + bytes / w) fitted to the machine's all-reduce runs for this run's
    backend, device, world size and GPU sharing: a LinkFit, why there is none (str), or None
    when the machine has no such all-reduce run."""
    env = results.environment
    wanted = CommGroup(env.backend, env.device_type, env.world_size, env.shared_gpu)
    for allreduce in machine.runs(AllReduceRecord.KIND):
        groups = comm_groups(allreduce.records)
        if wanted in groups:
            return fit_group(groups[wanted])
    return None


def gradient_bytes(results: ResultsFile) -> float | None:
    """s: bytes of float32 gradient a step of this run all-reduces (None without a parameter count)."""
    n = results.notes.get("n_parameters")
    return FLOAT32_BYTES * n if n else None


def bucket_sweep(records: list[StepRecord]) -> list[StepRecord]:
    """The sweep's bucketed variants (a plain ``bucketed-<N>MB``, no lever switched), by bucket size."""
    sweep = [r for r in records if r.bucket_size_mb is not None and r.variant == bucketed_name(r.bucket_size_mb)]
    return sorted(sweep, key=lambda r: r.bucket_size_mb)


def largest_parameter_bytes(model_size: str, context_length: int | None) -> int | None:
    """Bytes of the model's largest parameter (None for a size :mod:`cs336_basics.model` does not know)."""
    shapes = parameter_shapes({"model_size": model_size, "context_length": context_length})
    return max((FLOAT32_BYTES * math.prod(shape) for shape in shapes.values()), default=None)


@dataclass(frozen=True)
class BucketPrediction:
    """The model applied to one run of the sweep: what it predicts for the buckets built."""

    record: StepRecord
    closed_form_s: float  # o n_b + s / (w n_b): equal buckets, backward as fast as the channel
    channel_s: float  # n_b o + s / w: the channel busy for every bucket, back to back
    channel_range_s: tuple[float, float] | None  # the same over the 95% intervals of o and w (None: no intervals)
    wait_s: float | None  # the recursion on the buckets built and the measured backward (None: either unknown)


@dataclass(frozen=True)
class OverheadPrediction:
    """The overhead model applied to one DDP run with one fit."""

    s_bytes: float  # gradient bytes per step
    largest_param_bytes: float | None
    fit: LinkFit
    o_s: float  # the per-call cost used: the fit's, or 0 where the fit's is negative
    backward_s: float | None  # backward's compute, measured by the profiler (None: not profiled)
    n_b_opt: float  # unconstrained optimum bucket count
    b_opt_bytes: float  # s / n_b_opt = sqrt(s w o), at most s
    t_opt_s: float  # 2 sqrt(s o / w): the closed form's minimum
    rows: list[BucketPrediction]  # one per bucketed record of the sweep, by bucket size

    def predict(self, n_b: float) -> float:
        return exposed_overhead(self.s_bytes, self.fit.w_bytes_per_s, self.o_s, n_b)


def predict_overhead(n_parameters: int, largest_param_bytes: int | None, fit: LinkFit, sweep: list[StepRecord],
                     backward_s: float | None = None, intervals: FitIntervals | None = None) -> OverheadPrediction | str:
    """The closed form's optimum, and per bucket size of the sweep its closed form and, given a
    measured backward, the recursion on the buckets actually built; or why the model cannot
    be applied. A negative fitted ``o`` is used as 0 (:attr:`OverheadPrediction.o_s`)."""
    if not n_parameters or n_parameters <= 0:
        return f"no parameters to synchronise (got {n_parameters!r})"
    s = FLOAT32_BYTES * n_parameters
    # A negative intercept is a per-call cost below what the payloads resolve: taken as 0, the
    # same rule as bucket_size_mb="auto" (cs336_systems/ddp/auto_bucket.py).
    w, o = fit.w_bytes_per_s, max(fit.o_s, 0.0)
    rows = []
    for r in sweep:
        if not r.n_buckets:
            continue
        wait = predicted_wait(r.bucket_bytes, backward_s, w, o) if backward_s and r.bucket_bytes else None
        channel_range = None
        if intervals is not None:
            (o_low, o_high), (w_low, w_high) = intervals.o_s, intervals.w_bytes_per_s
            channel_range = (r.n_buckets * max(o_low, 0.0) + s / w_high, r.n_buckets * max(o_high, 0.0) + s / w_low)
        rows.append(BucketPrediction(r, exposed_overhead(s, w, o, r.n_buckets), r.n_buckets * o + s / w,
                                     channel_range, wait))
    return OverheadPrediction(s, largest_param_bytes, fit, o, backward_s, optimal_bucket_count(s, w, o),
                              optimal_bucket_bytes(s, w, o, largest_param_bytes or 1.0),
                              minimum_exposed_overhead(s, w, o), rows)
