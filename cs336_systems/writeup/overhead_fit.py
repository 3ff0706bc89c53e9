"""ddp_bucketed_benchmarking (b)'s inputs: ``o`` and ``w`` fitted to each line of the all-reduce benchmark.

The fit is :func:`cs336_systems.ddp.overhead_model.fit_latency_bandwidth` (through ``fit_group``); its
intervals resample each payload's timed iterations with a fixed seed, payloads in a fixed order. A
least-squares solve may round differently on another CPU, so ``fit_group`` and the intervals keep
every fitted number to a few significant digits (:func:`~cs336_systems.writeup.load.settled`): the
page and its figure then do not depend on the machine that renders them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.ddp.overhead_model import FitIntervals, bootstrap_latency_bandwidth
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import CommGroup, LinkFit, comm_groups, fit_group
from cs336_systems.writeup.load import MachineResults, settled

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def drawn_ms(seconds) -> np.ndarray:
    """Seconds as the milliseconds a figure draws: settled."""
    return np.array([settled(v * 1e3) for v in seconds])


@dataclass(frozen=True)
class GroupFit:
    """One line of the all-reduce benchmark (a backend, device, world size) and its fit."""

    group: CommGroup
    records: list[AllReduceRecord]  # measured, by payload
    fit: LinkFit | str  # the fit (settled by fit_group), or why there is none
    intervals: FitIntervals | None  # None without a fit or without iteration times


def fit_with_intervals(group: CommGroup, records: list[AllReduceRecord]) -> GroupFit:
    fit = fit_group(records)
    if isinstance(fit, str):
        return GroupFit(group, records, fit, None)
    intervals = None
    if all(r.times_s for r in records):
        try:
            found = bootstrap_latency_bandwidth([r.payload_bytes for r in records], [r.times_s for r in records],
                                                resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
            intervals = FitIntervals(tuple(map(settled, found.o_s)), tuple(map(settled, found.w_bytes_per_s)),
                                     found.resamples, found.fitted)
        except ValueError:
            intervals = None
    return GroupFit(group, records, fit, intervals)


def machine_fits(machine: MachineResults) -> list[GroupFit]:
    """Every line of the machine's all-reduce runs, the first run's where two runs share one."""
    fits: dict[CommGroup, GroupFit] = {}
    for results in machine.runs(AllReduceRecord.KIND):
        for group, records in comm_groups(results.records).items():
            if group not in fits:
                fits[group] = fit_with_intervals(group, records)
    return list(fits.values())


def fit_for_run(machine: MachineResults, results) -> GroupFit | None:
    """The line of the machine's all-reduce runs that a step run's backend, device, ranks and GPU sharing
    select, with its fit and intervals; None where the machine has no such line."""
    env = results.environment
    wanted = (env.backend, env.device_type, env.world_size, env.shared_gpu)
    return next((g for g in machine_fits(machine) if (g.group.backend, g.group.device_type, g.group.world_size,
                                                      g.group.shared_gpu) == wanted), None)


def fit_row(g: GroupFit) -> list:
    """The fit table's row: the line, the payloads, o and w with their intervals, R², the best algbw."""
    head = [g.group.label, ", ".join(fmt.size_mb(r.payload_mb) for r in g.records)]
    if isinstance(g.fit, str):
        return head + ["–", "–", "–", f"no fit: {g.fit}"]
    iv, best = g.intervals, max(g.records, key=lambda r: r.algbw_gbps)
    o = fmt.us(g.fit.o_s) + (f" ({fmt.us(iv.o_s[0])} to {fmt.us(iv.o_s[1])})" if iv else "")
    w = fmt.gbps(g.fit.w_bytes_per_s) + (f" ({fmt.gbps(iv.w_bytes_per_s[0])} to {fmt.gbps(iv.w_bytes_per_s[1])})"
                                         if iv else "")
    return head + [o, w, fmt.sig(g.fit.r2, 4), f"{fmt.sig(best.algbw_gbps)} at {fmt.size_mb(best.payload_mb)} MB"]


FIT_HEADERS = ["all-reduce line", "payloads fitted (MB)", "o (µs), 95% interval", "w (GB/s), 95% interval",
               "R² (relative residuals)", "highest measured algbw (GB/s)"]
