"""Numbers derived from all-reduce records: plot lines (groups), ranks per core, the o/w fit.

Pure functions over :class:`~cs336_systems.bench.allreduce.record.AllReduceRecord` lists, read
by the all-reduce page, the step benchmark's page and the overhead model's (ddp_bucketed_benchmarking
(b)'s inputs: ``o`` and ``w`` fitted to each line). The fit is
:func:`cs336_systems.ddp.overhead_model.fit_latency_bandwidth` (through ``fit_group``); its intervals
resample each payload's timed iterations with a fixed seed, payloads in a fixed order. A least-squares
solve may round differently on another CPU, so ``fit_group`` and the intervals keep every fitted
number to a few significant digits (:func:`~cs336_systems.writeup.load.settled`): the page and its
figure then do not depend on the machine that renders them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cs336_systems.bench.allreduce.record import AllReduceRecord, bus_bandwidth_factor
from cs336_systems.ddp.overhead_model import FitIntervals, bootstrap_latency_bandwidth, fit_latency_bandwidth
from cs336_systems.writeup import fmt
from cs336_systems.writeup.load import MachineResults, settled


@dataclass(frozen=True, order=True)
class CommGroup:
    """Records that share everything but the payload: one line of the all-reduce plot."""

    backend: str
    device_type: str
    world_size: int
    shared_gpu: bool

    @property
    def label(self) -> str:
        where = "gloo ranks sharing one GPU" if self.shared_gpu else self.device_type
        return f"{self.backend} ({where}), {self.world_size} ranks"


def comm_groups(records: list[AllReduceRecord]) -> dict[CommGroup, list[AllReduceRecord]]:
    """Measured records by group, groups sorted, each group's records by payload."""
    groups: dict[CommGroup, list[AllReduceRecord]] = {}
    for r in records:
        if r.measured:
            groups.setdefault(CommGroup(r.backend, r.device_type, r.world_size, r.shared_gpu), []).append(r)
    return {k: sorted(groups[k], key=lambda r: r.payload_bytes) for k in sorted(groups)}


def ranks_per_core(world_size: int, cores: int | None) -> float | None:
    """How many ranks share each core when they outnumber the cores; None when they do not (or
    the core count is unknown)."""
    if not cores or world_size <= cores:
        return None
    return world_size / cores


def time_sharing_bound(n_from: int, n_to: int, cores: int) -> float:
    """Time ratio (``n_to`` ranks over ``n_from``) if every byte's work queued for ``cores`` cores.

    In a ring each rank moves 2(n−1)/n of the payload; with more ranks than cores the n ranks'
    work shares the cores, so a rank's time also stretches by n / cores. With one process per
    core or fewer, only the ring's factor applies.
    """
    def time_units(n: int) -> float:
        return bus_bandwidth_factor(n) * max(1.0, n / cores)
    return time_units(n_to) / time_units(n_from)


@dataclass(frozen=True)
class LinkFit:
    """``median time = o + bytes / w`` fitted to one group's records."""

    o_s: float  # per-call cost, seconds
    w_bytes_per_s: float  # bandwidth, bytes per second (payload / time, i.e. algbw)
    r2: float
    n_points: int


def fit_group(group: list[AllReduceRecord]) -> LinkFit | str:
    """The least-squares fit, settled (a solve may round differently on another CPU), or why there is none."""
    try:
        o, w, r2 = fit_latency_bandwidth([r.payload_bytes for r in group], [r.median_s or 0.0 for r in group])
    except ValueError as e:
        return str(e)
    return LinkFit(settled(o), settled(w), settled(r2), len(group))


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
