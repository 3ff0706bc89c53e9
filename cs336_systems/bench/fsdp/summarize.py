"""From what the ranks measured to one record per configuration.

Step times are compared with our FSDP's round by round (see :mod:`cs336_systems.bench.stats`):
step ``i`` of every configuration ran in the same round, so the per-round difference cancels
most of the machine's drift, and its median comes with a distribution-free 95% interval.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from cs336_systems.bench.fsdp.configurations import CONFIGURATIONS, DESCRIPTIONS
from cs336_systems.bench.fsdp.formulas import (
    FSDP,
    formula_traffic_bytes,
    largest_model_size,
    largest_parameters,
    traffic_bytes,
)
from cs336_systems.bench.fsdp.record import MEMORY_PARTS, FsdpStepRecord, FsdpTimeline
from cs336_systems.bench.fsdp.setting import FsdpSetting
from cs336_systems.bench.stats import paired_median


@dataclass(frozen=True)
class Measured:
    """One configuration as the ranks measured it."""

    step_times_s: list[float]  # slowest rank per timed step, round order
    memory: list[float]  # the largest rank's [peak, parameters, gradients, optimizer state,
    # activations, resident, allocator peak (-1: none)]
    payload_bytes: dict[str, float]  # rank 0's, by collective kind
    calls: dict[str, int]
    mode: str | None = None  # our FSDP's mode as built (FullyShardedDataParallel.mode); None: others


def summarize(measured: dict[str, Measured], timelines: dict[str, FsdpTimeline], setting: FsdpSetting, *,
              n_parameters: int, parameter_bytes: int, free_per_rank: float, world_size: int) -> list[FsdpStepRecord]:
    """One record per configuration, in ``CONFIGURATIONS`` order, built on every rank from the same
    figures (slowest rank's times, largest rank's memory)."""
    n, world = n_parameters, world_size
    ours = measured[FSDP].step_times_s
    records = []
    for name in CONFIGURATIONS:
        m = measured[name]
        steps = sorted(m.step_times_s)
        median = statistics.median(steps)
        diff, interval = (None, None) if name == FSDP else paired_median(m.step_times_s, ours)
        peak, *rest = m.memory
        parts = dict(zip(MEMORY_PARTS, rest))
        resident, allocator = rest[len(MEMORY_PARTS)], rest[len(MEMORY_PARTS) + 1]
        per_parameter = (parts["parameters"] + parts["gradients"] + parts["optimizer_state"]) / n
        largest = largest_parameters(per_parameter, parts["activations"], free_per_rank)
        records.append(FsdpStepRecord(
            configuration=name,
            description=DESCRIPTIONS[name],
            fsdp_mode=m.mode,
            step_times_s=list(m.step_times_s),
            median_step_s=median,
            min_step_s=steps[0],
            max_step_s=steps[-1],
            vs_fsdp_s=diff,
            vs_fsdp_ci95_s=list(interval) if interval else None,
            tokens_per_s=setting.tokens_per_step / median,
            steps_timed=len(steps),
            n_parameters=n,
            peak_bytes=peak,
            peak_parameters_bytes=parts["parameters"],
            peak_gradients_bytes=parts["gradients"],
            peak_optimizer_state_bytes=parts["optimizer_state"],
            peak_activations_bytes=parts["activations"],
            resident_bytes=resident,
            allocator_peak_bytes=None if allocator < 0 else allocator,
            payload_bytes=dict(sorted(m.payload_bytes.items())),
            calls=dict(sorted(m.calls.items())),
            traffic_bytes=traffic_bytes(m.payload_bytes, world),
            formula_traffic_bytes=formula_traffic_bytes(name, parameter_bytes, world),
            bytes_per_parameter=per_parameter,
            free_bytes_per_rank=free_per_rank,
            largest_parameters=largest,
            largest_model_size=largest_model_size(largest),
            timeline=timelines.get(name),
        ))
    return records
