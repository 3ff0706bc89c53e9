"""A DDP step run's one table: every variant, compute-only once, torch DDP beside ours.

Its columns are defined in ``templates/details/ddp_step.md.j2``; at world size 1 (nothing
communicated) the same table shows each wrapper's own cost.
"""

from __future__ import annotations

from typing import Iterable

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup import fmt

VARIANT_HEADERS = ["variant", "buckets", "all-reduce calls / step", "median step (ms)", "min–max (ms)",
                   "sync after backward (ms)", "sync share", "exposed overhead (ms)", "its 95% interval (ms)",
                   "tokens/s"]


def variant_row(r: StepRecord) -> list:
    """Calls, step time and spread, sync phase and its share, exposed overhead, throughput."""
    calls = r.allreduce_calls_per_step
    if r.variant == TORCH_DDP:
        sync_cell = share_cell = "inside backward"
    elif r.variant == COMPUTE_ONLY:
        sync_cell = share_cell = "–"
    else:
        sync_cell, share_cell = fmt.ms(r.median_sync_s), fmt.pct(r.sync_share)
    return [r.variant, "–" if r.n_buckets is None else r.n_buckets,
            "0" if r.variant == COMPUTE_ONLY else ("–" if calls is None else f"{calls:g}"),
            fmt.ms(r.median_step_s), f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}", sync_cell, share_cell,
            fmt.ms(r.exposed_overhead_s),
            "–" if r.variant == COMPUTE_ONLY else fmt.ms_interval(r.exposed_overhead_ci95_s), fmt.sig(r.tokens_per_s)]


def variant_table(records: Iterable[StepRecord]) -> str:
    return fmt.table(VARIANT_HEADERS, [variant_row(r) for r in records])
