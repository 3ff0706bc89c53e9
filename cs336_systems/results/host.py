"""What the host did to a run: CPU time stolen by the hypervisor, a fixed computation's speed, the spread.

Counting other jobs' threads (``results.others``) sees only this machine. A virtual machine's
host can still take its CPUs away (another guest, a slower host after a migration): a run
re-taken with other jobs' threads at 0.00 had its compute-only step spread 1.80x max/min and
ran 1.49x slower than the run before it. :class:`Host` records three witnesses of that, each
read in the script's main process:

* ``/proc/stat``'s *steal* time over the run (the hypervisor ran someone else on our CPUs), in
  seconds and as a share of all CPU time that passed (``proc(5)``, "steal");
* a fixed *calibration*: the median time of one small float32 matmul on one thread, taken when
  the script started and again when its results were written. Its ratio after/before says
  whether the machine's speed moved during the run; its value compares runs with each other;
* the *spread* of the run's no-communication step (the ``compute-only`` variant, where the
  run has one): interquartile range over median and max over min of its step times.

:meth:`Host.verdict` files the run as quiet or not, with its reasons, against the limits below.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

PROC_STAT = "/proc/stat"
# The compute-only step's interquartile range over its median, at most (issue 59's Done-when): the
# 72440ec run had 0.048, and a fresh clone's run beside 0.25% steal, not quiet, 0.145.
SPREAD_LIMIT = 0.10
STEAL_LIMIT = 0.02  # of all CPU time over the run: above it the hypervisor took a share the spread would show
CALIBRATION_LIMIT = 0.10  # |after/before - 1|: the machine's speed moved by more than a tenth during the run
CALIBRATION_SIZE = 512  # n of the n x n float32 matmul: a few milliseconds on one core
CALIBRATION_REPEATS = 41  # its median over these: under a second, and robust to a stray preemption
COMPUTE_ONLY = "compute-only"  # the variant without communication, in runs that have one


def cpu_times(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot, from ``/proc/stat``'s ``cpu`` line; None
    where there is none (not Linux). Guest time is already inside user time, so it is not added."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("cpu "):
                    ticks = [int(x) for x in line.split()[1:]]
                    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])
    except (OSError, ValueError):
        return None
    return None


def calibrate(size: int = CALIBRATION_SIZE, repeats: int = CALIBRATION_REPEATS) -> float:
    """Median seconds of one ``size`` x ``size`` float32 matmul on one thread: the same fixed work
    every time, so a slower result means a slower (or shared) CPU, not different code."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator)
        b = torch.randn(size, size, generator=generator)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def spread(times: Sequence[float]) -> tuple[float, float] | None:
    """(interquartile range / median, max / min) of ``times``; None for fewer than 4 of them."""
    if len(times) < 4:
        return None
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / median, max(times) / min(times)


def compute_only_times(records: Sequence[Any]) -> list[float] | None:
    """The step times of a run's ``compute-only`` record, where it has one (the step benchmarks)."""
    for record in records:
        if getattr(record, "variant", None) == COMPUTE_ONLY and getattr(record, "step_times_s", None):
            return list(record.step_times_s)
    return None


@dataclass(frozen=True)
class Host:
    """What the host did over one run; ``quiet`` and ``reasons`` are :meth:`verdict`'s, as filed."""

    steal_s: float  # CPU time stolen over the run, all CPUs together (/proc/stat), seconds
    steal_share: float  # of all CPU time that passed over the run
    calibration_before_s: float  # the fixed matmul (calibrate()) when the script started
    calibration_after_s: float  # and when its results were written
    compute_only_iqr: float | None = None  # interquartile range / median of the no-communication step
    compute_only_max_min: float | None = None  # its max / min; both None where the run has no such step
    quiet: bool | None = None  # None until verdict() files it
    reasons: list[str] = field(default_factory=list)  # why not quiet, in words

    @property
    def calibration_drift(self) -> float:
        """after / before - 1: how much slower (positive) the fixed matmul ran at the end."""
        return self.calibration_after_s / self.calibration_before_s - 1

    def verdict(self, load_reason: str | None = None) -> Host:
        """This record with ``quiet`` and ``reasons`` filled in: every limit above, and the load's
        reason (results.environment.Load) where the caller gives one."""
        reasons = [load_reason] if load_reason else []
        if self.steal_share > STEAL_LIMIT:
            reasons.append(f"the hypervisor stole {self.steal_share:.1%} of CPU time (limit {STEAL_LIMIT:.0%})")
        if abs(self.calibration_drift) > CALIBRATION_LIMIT:
            reasons.append(f"the calibration matmul ran {self.calibration_drift:+.0%} at the end "
                           f"({self.calibration_before_s * 1e3:.2f} ms, then {self.calibration_after_s * 1e3:.2f} ms; "
                           f"limit ±{CALIBRATION_LIMIT:.0%})")
        if self.compute_only_iqr is not None and self.compute_only_iqr > SPREAD_LIMIT:
            reasons.append(f"the compute-only step's interquartile range is {self.compute_only_iqr:.3f} of its "
                           f"median (limit {SPREAD_LIMIT}; max/min {self.compute_only_max_min:.2f})")
        return replace(self, quiet=not reasons, reasons=reasons)

    def describe(self) -> str:
        """The record in words, for a setting line or an error."""
        text = (f"steal {self.steal_share:.2%}, calibration {self.calibration_before_s * 1e3:.2f} → "
                f"{self.calibration_after_s * 1e3:.2f} ms")
        if self.compute_only_iqr is not None:
            text += (f", compute-only step spread {self.compute_only_iqr:.3f} of its median "
                     f"(max/min {self.compute_only_max_min:.2f})")
        return text


class HostWatch:
    """The start of a run: /proc/stat's counters and the calibration, read once; :meth:`record` ends it."""

    def __init__(self, proc_stat: str = PROC_STAT):
        self.proc_stat = proc_stat
        self.start = cpu_times(proc_stat)
        self.calibration_before_s = calibrate()

    def record(self, records: Sequence[Any] = ()) -> Host | None:
        """What the host did since the start; None where /proc/stat cannot say (not Linux)."""
        end = cpu_times(self.proc_stat)
        if self.start is None or end is None:
            return None
        steal, total = end[0] - self.start[0], end[1] - self.start[1]
        spread_of = spread(compute_only_times(records) or [])
        return Host(round(steal / os.sysconf("SC_CLK_TCK"), 3), round(steal / total if total else 0.0, 5),
                    round(self.calibration_before_s, 7), round(calibrate(), 7),
                    *((round(spread_of[0], 4), round(spread_of[1], 4)) if spread_of else (None, None)))
