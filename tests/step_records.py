"""Step records as a run's ranks build them, from planted measurements (no ranks started).

Each variant is given as the keyword arguments of :meth:`StepRecord.from_steps` (without the
compute-only times and the tokens, which every variant of a run shares); the compute-only
variant must be among them, since every exposed overhead is paired with its steps.
"""

from __future__ import annotations

from typing import Any

from cs336_systems.bench.step import COMPUTE_ONLY, StepRecord


def records_from_measured(measured: list[dict[str, Any]], tokens_per_step: int) -> list[StepRecord]:
    floor = next(m["step_times_s"] for m in measured if m["variant"] == COMPUTE_ONLY)
    return [StepRecord.from_steps(compute_only_s=floor, tokens_per_step=tokens_per_step, **m) for m in measured]
