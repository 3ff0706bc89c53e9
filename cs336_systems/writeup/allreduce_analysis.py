"""Numbers derived from all-reduce records: plot lines (groups), noise, saturation, the o/w fit.

Pure functions over :class:`~cs336_systems.bench.allreduce.record.AllReduceRecord` lists; the
all-reduce section and the overhead-model section turn them into text. Noise is judged by each
record's own spread: two medians whose p10–p90 ranges overlap are not told apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.bench.allreduce.record import AllReduceRecord, bus_bandwidth_factor
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth


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


def spreads_overlap(a: AllReduceRecord, b: AllReduceRecord) -> bool:
    """Whether the p10–p90 time ranges of two measured records overlap (their medians are then
    indistinguishable here)."""
    return a.p10_s <= b.p90_s and b.p10_s <= a.p90_s  # type: ignore[operator]


def saturation_point(group: list[AllReduceRecord], within: float = 0.9) -> tuple[AllReduceRecord, AllReduceRecord]:
    """(record with the peak busbw, smallest payload whose busbw is within ``within`` of that peak)."""
    peak = max(group, key=lambda r: r.busbw_gbps)  # type: ignore[arg-type, return-value]
    first = next(r for r in group if r.busbw_gbps >= within * peak.busbw_gbps)  # type: ignore[operator]
    return peak, first


def levels_off_at(group: list[AllReduceRecord]) -> tuple[AllReduceRecord, AllReduceRecord]:
    """(record with the peak median busbw, smallest payload whose busbw range (at its p90 and
    p10 times) overlaps the peak's): from there on, more bytes buy no bandwidth we can resolve."""
    peak = max(group, key=lambda r: r.busbw_gbps)  # type: ignore[arg-type, return-value]
    low, high = peak.busbw_range_gbps()
    for r in group:
        r_low, r_high = r.busbw_range_gbps()
        if r_low <= high and low <= r_high:
            return peak, r
    return peak, peak


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
    """The least-squares fit, or why there is none."""
    try:
        o, w, r2 = fit_latency_bandwidth([r.payload_bytes for r in group], [r.median_s for r in group])
    except ValueError as e:
        return str(e)
    return LinkFit(o, w, r2, len(group))
