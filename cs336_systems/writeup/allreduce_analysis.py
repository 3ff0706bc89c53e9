"""Numbers derived from all-reduce records: plot lines (groups), ranks per core, the o/w fit.

Pure functions over :class:`~cs336_systems.bench.allreduce.record.AllReduceRecord` lists, read
by the all-reduce page, the step benchmark's page and the overhead model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.bench.allreduce.record import AllReduceRecord, bus_bandwidth_factor
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth
from cs336_systems.writeup.load import settled


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
