"""One profiled training step reduced to intervals: its phases, backward compute, communication.

Times are microseconds since the step's ``train_step`` range began (the Chrome trace's unit).
A :class:`StepTimeline` is what the extraction (trace.py) returns, what ``profile.json`` stores
(so the writeup draws the timelines without the traces) and what the figure draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

Interval = tuple[float, float]  # (start, end) in microseconds since the step's start
PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer_step")


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total_length(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals`` (overlapping parts count once)."""
    return sum(end - start for start, end in merge_intervals(intervals))


def length_inside(intervals: Iterable[Interval], window: Interval) -> float:
    """How much of the union of ``intervals`` lies inside ``window``."""
    low, high = window
    return sum(max(0.0, min(b, high) - max(a, low)) for a, b in merge_intervals(intervals))


# Stored to the nanosecond: the trace's own clock is no finer, and the file stays small.
DECIMALS = 3


def _interval(pair: Iterable[float]) -> Interval:
    start, end = pair
    return round(float(start), DECIMALS), round(float(end), DECIMALS)


@dataclass(frozen=True)
class StepTimeline:
    """One training step of one rank, reduced to what the overlap question needs."""

    duration_us: float  # the "train_step" range
    phases: dict[str, Interval]  # record_function ranges of PHASES present in the step
    backward_compute: list[Interval]  # merged
    communication: list[Interval]  # merged all-reduce intervals
    n_comm_events: int  # all-reduce events (before merging)
    device_clock: bool  # True: compute is GPU kernels; False: CPU threads
    backend: str  # whose events make the communication lane: "gloo" or "nccl"

    def __post_init__(self) -> None:
        # Read back from JSON, intervals are lists and phases come in key order: restore the
        # tuples and the phases' order, so a stored timeline equals (and draws as) the extracted
        # one; times are rounded to DECIMALS first, so storing them loses nothing further.
        phases = {name: _interval(self.phases[name]) for name in PHASES if name in self.phases}
        object.__setattr__(self, "duration_us", round(float(self.duration_us), DECIMALS))
        object.__setattr__(self, "phases", phases)
        object.__setattr__(self, "backward_compute", [_interval(i) for i in self.backward_compute])
        object.__setattr__(self, "communication", [_interval(i) for i in self.communication])

    @property
    def lanes_from(self) -> str:
        compute = "GPU kernels" if self.device_clock else "autograd nodes on the CPU"
        if self.backend == "nccl":
            return f"compute: {compute}; all-reduce: NCCL kernels"
        copies = " and their host-device copies" if self.device_clock else ""
        return f"compute: {compute}; all-reduce: gloo worker threads{copies}"

    @property
    def backward_range(self) -> Interval:
        """When backward computes: the span of its kernels on GPU (they run after their
        launches), the ``backward`` range on CPU."""
        if self.device_clock and self.backward_compute:
            return self.backward_compute[0][0], self.backward_compute[-1][1]
        return self.phases["backward"]

    @property
    def communication_us(self) -> float:
        return total_length(self.communication)

    @property
    def backward_us(self) -> float:
        start, end = self.backward_range
        return end - start

    @property
    def overlap_fraction(self) -> float:
        """Share of communication time inside the backward range (0 without communication)."""
        total = self.communication_us
        return length_inside(self.communication, self.backward_range) / total if total else 0.0
