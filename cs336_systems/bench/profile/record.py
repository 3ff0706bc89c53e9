"""One profiled variant, as stored in ``profile/profile.json``: its step timelines and their summary.

The timelines are stored as intervals (phases, backward compute, communication, per profiled
step), so the writeup draws them from this file alone; the Chrome trace they came from sits
beside it for a trace viewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.bench.profile.timeline import StepTimeline
from cs336_systems.results.schema import Record

US = 1e-6  # seconds per microsecond


@dataclass(frozen=True)
class ProfileRecord(Record):
    """A variant's profiled steps (rank 0), the last one summarised."""

    KIND: ClassVar[str] = "profile"
    VERSION: ClassVar[int] = 1

    variant: str  # "naive" or "per-parameter"
    trace: str  # file name of the Chrome trace, beside profile.json
    timelines: list[StepTimeline]  # one per profiled step, in order; the last is summarised
    overlap_fraction: float  # share of the last step's all-reduce time inside backward
    overlap_fraction_per_step: list[float]
    communication_s: float  # the last step's all-reduce time (union of intervals)
    backward_s: float  # its backward range
    step_s: float  # its whole "train_step" range
    n_comm_events: int  # its all-reduce events
    lanes_from: str  # which events make the lanes (by backend and device)

    @property
    def timeline(self) -> StepTimeline:
        """The last profiled step: the steadiest."""
        return self.timelines[-1]

    @classmethod
    def from_timelines(cls, variant: str, trace: str, timelines: list[StepTimeline]) -> "ProfileRecord":
        if not timelines:
            raise ValueError(f"no profiled step of {variant!r} to summarise")
        last = timelines[-1]
        return cls(
            variant=variant,
            trace=trace,
            timelines=list(timelines),
            overlap_fraction=last.overlap_fraction,
            overlap_fraction_per_step=[t.overlap_fraction for t in timelines],
            communication_s=last.communication_us * US,
            backward_s=last.backward_us * US,
            step_s=last.duration_us * US,
            n_comm_events=last.n_comm_events,
            lanes_from=last.lanes_from,
        )
