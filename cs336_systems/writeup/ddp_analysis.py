"""Numbers derived from DDP step records: which runs, variants, the bucket sweep, the model's predictions.

Pure functions over :class:`~cs336_systems.bench.step.record.StepRecord` lists; the sections
turn them into text. A machine may hold several ``ddp_step`` runs: the lever ablation
(``ddp_step-ablation.json``) has its own section, every other run is read by the problem
sections (``ddp_step.json``; ``ddp_step-nccl1.json``, NCCL at world size 1, from the one-GPU suite).
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import bucketed_name
from cs336_systems.ddp.overhead_model import (
    exposed_overhead,
    minimum_exposed_overhead,
    optimal_bucket_bytes,
    optimal_bucket_count,
)
from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.writeup.allreduce_analysis import CommGroup, LinkFit, comm_groups, fit_group
from cs336_systems.writeup.load import MachineResults, ResultsFile, WriteupInputs

STEP_KIND = StepRecord.KIND
ABLATION_RUN = f"{STEP_KIND}-ablation"  # the results file (stem) of the lever ablation
FLOAT32_BYTES = 4  # the benchmarks train in float32, so gradients are 4 bytes per parameter


def step_runs(inputs: WriteupInputs) -> list[tuple[MachineResults, ResultsFile]]:
    """Every DDP step run but the lever ablation, machines in tag order."""
    return [(m, f) for m, f in inputs.runs(STEP_KIND) if f.name != ABLATION_RUN]


def ablation_runs(inputs: WriteupInputs) -> list[tuple[MachineResults, ResultsFile]]:
    """The lever ablation of each machine that ran it."""
    return [(m, f) for m, f in inputs.runs(STEP_KIND) if f.name == ABLATION_RUN]


def by_variant(records: list[StepRecord]) -> dict[str, StepRecord]:
    return {r.variant: r for r in records}


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
    """Bytes of the model's largest parameter, from a model built on the meta device.

    The meta device gives shapes without allocating storage, so this costs nothing even for the
    largest sizes. None when the size is not one :mod:`cs336_basics.model` knows.
    """
    import torch

    from cs336_basics.model import TransformerLM, model_config

    try:
        config = model_config(model_size, context_length)
    except (ValueError, KeyError):
        return None
    with torch.device("meta"):
        model = TransformerLM(config)
    return max(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class OverheadPrediction:
    """The overhead model applied to one DDP run with one fit."""

    s_bytes: float  # gradient bytes per step
    largest_param_bytes: float | None
    fit: LinkFit
    n_b_opt: float  # unconstrained optimum bucket count
    b_unconstrained_bytes: float  # s / n_b_opt = sqrt(s w o)
    t_unconstrained_s: float  # 2 sqrt(s o / w): the overhead at n_b_opt
    b_opt_bytes: float  # optimum bucket size, clamped to [largest parameter, s]
    t_opt_s: float  # predicted exposed overhead at the clamped optimum
    rows: list[tuple[StepRecord, float]]  # (bucketed record, predicted overhead at its n_buckets)

    def predict(self, n_b: float) -> float:
        return exposed_overhead(self.s_bytes, self.fit.w_bytes_per_s, self.fit.o_s, n_b)


def predict_overhead(
    n_parameters: int, largest_param_bytes: int | None, fit: LinkFit, sweep: list[StepRecord]
) -> OverheadPrediction | str:
    """Predicted optimum and per-bucket-size overheads, or why the model cannot be applied."""
    if fit.o_s < 0:
        return (
            f"the fitted per-call cost is negative ({fit.o_s * 1e6:.3g} µs): below what these "
            "payloads resolve, so the model's optimum is undefined"
        )
    s = FLOAT32_BYTES * n_parameters
    w, o = fit.w_bytes_per_s, fit.o_s
    lower = largest_param_bytes if largest_param_bytes else 1.0
    b_opt = optimal_bucket_bytes(s, w, o, lower)
    rows = [(r, exposed_overhead(s, w, o, r.n_buckets)) for r in sweep if r.n_buckets]
    n_b_opt = optimal_bucket_count(s, w, o)
    return OverheadPrediction(
        s_bytes=s,
        largest_param_bytes=largest_param_bytes,
        fit=fit,
        n_b_opt=n_b_opt,
        b_unconstrained_bytes=s / n_b_opt,
        t_unconstrained_s=minimum_exposed_overhead(s, w, o),
        b_opt_bytes=b_opt,
        t_opt_s=exposed_overhead(s, w, o, s / b_opt),
        rows=rows,
    )
