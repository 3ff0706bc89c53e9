"""Numbers derived from all-reduce records: plot lines (groups), saturation points, the o/w fit.

Pure functions over :class:`~cs336_systems.bench.allreduce.record.AllReduceRecord` lists; the
all-reduce section and the overhead-model section turn them into text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cs336_systems.ddp.overhead_model import fit_latency_bandwidth

Record = dict[str, Any]


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


def is_measured(record: Record) -> bool:
    return not record.get("skipped") and record.get("median_s") is not None


def comm_groups(records: list[Record]) -> dict[CommGroup, list[Record]]:
    """Measured records by group, groups sorted, each group's records by payload."""
    groups: dict[CommGroup, list[Record]] = {}
    for r in records:
        if is_measured(r):
            device = r.get("device_type", "cpu")
            key = CommGroup(r["backend"], device, int(r["world_size"]), bool(r.get("shared_gpu")))
            groups.setdefault(key, []).append(r)
    return {k: sorted(groups[k], key=lambda r: r["payload_bytes"]) for k in sorted(groups)}


def saturation_point(group: list[Record], within: float = 0.9) -> tuple[Record, Record]:
    """(record with the peak busbw, smallest payload whose busbw is within ``within`` of that peak)."""
    peak = max(group, key=lambda r: r["busbw_gbps"])
    first = next(r for r in group if r["busbw_gbps"] >= within * peak["busbw_gbps"])
    return peak, first


@dataclass(frozen=True)
class LinkFit:
    """``median time = o + bytes / w`` fitted to one group's records."""

    o_s: float  # per-call cost, seconds
    w_bytes_per_s: float  # bandwidth, bytes per second (payload / time, i.e. algbw)
    r2: float
    n_points: int


def fit_group(group: list[Record]) -> LinkFit | str:
    """The least-squares fit, or why there is none."""
    try:
        o, w, r2 = fit_latency_bandwidth([r["payload_bytes"] for r in group], [r["median_s"] for r in group])
    except ValueError as e:
        return str(e)
    return LinkFit(o, w, r2, len(group))


# ---------------------------------------------------------------------------------------------
# DDP step benchmark


