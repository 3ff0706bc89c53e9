"""Numbers derived from DDP step records: variants, the bucket sweep, the overhead model's predictions.

Pure functions over the records the step benchmark wrote; the sections turn them into text.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from cs336_systems.ddp.overhead_model import (
    exposed_overhead,
    minimum_exposed_overhead,
    optimal_bucket_bytes,
    optimal_bucket_count,
)

from cs336_systems.writeup.allreduce_analysis import LinkFit

Record = dict[str, Any]
FLOAT32_BYTES = 4  # the benchmarks train in float32, so gradients are 4 bytes per parameter


def by_variant(records: list[Record]) -> dict[str, Record]:
    return {r["variant"]: r for r in records}


def comm_share(record: Record) -> float | None:
    """Median over timed steps of (time in gradient synchronisation / step time)."""
    steps, syncs = record.get("step_times_s"), record.get("sync_times_s")
    if not steps or not syncs or len(steps) != len(syncs):
        return None
    return statistics.median(sync / step for sync, step in zip(syncs, steps))


def bucket_sweep(records: list[Record]) -> list[Record]:
    """The bucketed variants, by bucket size."""
    sweep = [r for r in records if r.get("bucket_size_mb") is not None]
    return sorted(sweep, key=lambda r: r["bucket_size_mb"])


def largest_parameter_bytes(model_size: str, context_length: int | None) -> int | None:
    """Bytes of the model's largest parameter, from a model built on the meta device.

    The meta device gives shapes without allocating storage, so this costs nothing even for the
    largest sizes. None when the size is not one :mod:`cs336_systems.model` knows.
    """
    import torch

    from cs336_systems.model import TransformerLM, model_config

    try:
        config = model_config(model_size, context_length)
    except ValueError:
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
    rows: list[tuple[Record, float]]  # (bucketed record, predicted overhead at its n_buckets)

    def predict(self, n_b: float) -> float:
        return exposed_overhead(self.s_bytes, self.fit.w_bytes_per_s, self.fit.o_s, n_b)


def predict_overhead(
    n_parameters: int, largest_param_bytes: int | None, fit: LinkFit, sweep: list[Record]
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
    rows = [(r, exposed_overhead(s, w, o, r["n_buckets"])) for r in sweep if r.get("n_buckets")]
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
