"""Every comparison of two DDP variants: the median per-round difference and its 95% sign-test interval.

Variants of one step run were timed in the same rounds (:func:`cs336_systems.bench.stats.paired_median`);
``templates/paired.md.j2`` words a difference by its interval, never ranking by medians alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cs336_systems.bench.stats import median_interval, one_side_chance, paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.writeup import fmt


def fewest_rounds_for_an_interval(confidence: float = 0.95) -> int:
    """The fewest paired rounds for which the sign-test interval exists at ``confidence``."""
    n = 1
    while median_interval([0.0] * n, confidence) is None:
        n += 1
    return n


@dataclass(frozen=True)
class Paired:
    """Variant ``a``'s step minus variant ``b``'s, round by round."""

    a: str
    b: str
    median_s: float  # median over rounds of a's step - b's step
    interval_s: tuple[float, float] | None  # its 95% sign-test interval; None: too few rounds
    rounds: int
    what: str = "step"  # what was compared: "step", or "sync after backward"
    unfit: str | None = None  # why the run's times decide nothing (fmt.not_evidence); None: they may

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes zero (the sign of the difference is a finding) in a run whose
        times are evidence."""
        return self.unfit is None and self.interval_s is not None and (self.interval_s[0] > 0 or self.interval_s[1] < 0)

    @property
    def reading(self) -> str:
        """A table cell: "a slower", "a faster", "indistinguishable here", "no interval", or "not evidence"."""
        if self.unfit:
            return f"not evidence: {self.unfit}"
        if self.interval_s is None:
            return f"no 95% interval ({self.rounds} rounds; it needs {fewest_rounds_for_an_interval()})"
        if not self.resolved:
            return "indistinguishable here"
        return f"{self.a} {'slower' if self.median_s > 0 else 'faster'}"


def paired(a: StepRecord, b: StepRecord, unfit: str | None = None) -> Paired:
    """The paired difference of two records' steps (one run; ``unfit``: fmt.not_evidence of its file)."""
    difference, interval = paired_median(a.step_times_s, b.step_times_s, steps_per_round=a.steps_per_round)
    return Paired(a.variant, b.variant, difference, interval, len(a.step_times_s) // a.steps_per_round, unfit=unfit)


def paired_sync(a: StepRecord, b: StepRecord, unfit: str | None = None) -> Paired | None:
    """The paired difference of two records' synchronisation after backward; None if one has none."""
    if not a.sync_times_s or not b.sync_times_s:
        return None
    difference, interval = paired_median(a.sync_times_s, b.sync_times_s, steps_per_round=a.steps_per_round)
    return Paired(a.variant, b.variant, difference, interval, len(a.sync_times_s) // a.steps_per_round,
                  "sync after backward", unfit)


def by_chance(differences: Iterable[Paired], sides: int = 2) -> float:
    """The one multiple-comparison rule of every page: each resolved interval counts, and beside the
    count stands how many of the comparisons would resolve by chance alone were nothing different: the
    sign test's actual error per comparison (:func:`one_side_chance` per side, 1.06% at 16 rounds, not a
    nominal 2.5%), summed over those with an interval. ``sides``: 1 for wins in one direction."""
    return sum(sides * (one_side_chance(d.rounds) or 0.0) for d in differences if d.interval_s is not None)


def signed_ms(seconds: float) -> str:
    """A difference in ms with its sign: "+12.3", "-4.00", "0"."""
    text = fmt.ms(seconds)
    return text if seconds <= 0 else "+" + text


def paired_table(differences: Iterable[Paired]) -> str:
    """One row per comparison: the median per-round difference, its interval, and what it says."""
    rows = [[f"{d.a} − {d.b}" + ("" if d.what == "step" else f" ({d.what})"), signed_ms(d.median_s),
             fmt.ms_interval(d.interval_s), d.reading] for d in differences]
    return fmt.table(["a − b, per round", "median (ms)", "95% interval (ms)", "reading"], rows, align="lrrl")
