"""Every comparison of two DDP variants in the writeup: a paired difference with its 95% interval.

Two variants of one step run were timed in the same rounds, so the writeup compares them only
through the median of their per-round step differences and its sign-test interval
(:func:`cs336_systems.bench.stats.paired_median`). The words follow the interval: a difference
whose interval holds zero is "indistinguishable here", one whose interval excludes zero is
stated with its sign, and a run with too few rounds for an interval says so. Nothing is ranked
by medians alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cs336_systems.bench.stats import median_interval, paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.writeup import fmt

INDISTINGUISHABLE = "indistinguishable here"


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

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes zero (the sign of the difference is a finding)."""
        return self.interval_s is not None and (self.interval_s[0] > 0 or self.interval_s[1] < 0)

    @property
    def reading(self) -> str:
        """One phrase: "a slower", "a faster", "indistinguishable here", or "no interval"."""
        if self.interval_s is None:
            return f"no 95% interval ({self.rounds} rounds; it needs {fewest_rounds_for_an_interval()})"
        if not self.resolved:
            return INDISTINGUISHABLE
        return f"{self.a} slower" if self.median_s > 0 else f"{self.a} faster"


def paired(a: StepRecord, b: StepRecord) -> Paired:
    """The paired difference of two records' steps (one run)."""
    difference, interval = paired_median(a.step_times_s, b.step_times_s)
    return Paired(a.variant, b.variant, difference, interval, len(a.step_times_s))


def paired_sync(a: StepRecord, b: StepRecord) -> Paired | None:
    """The paired difference of two records' synchronisation after backward; None if one has none."""
    if not a.sync_times_s or not b.sync_times_s:
        return None
    difference, interval = paired_median(a.sync_times_s, b.sync_times_s)
    return Paired(a.variant, b.variant, difference, interval, len(a.sync_times_s), "sync after backward")


def signed_ms(seconds: float) -> str:
    """A difference in ms with its sign: "+12.3", "-4.00", "0"."""
    text = fmt.ms(seconds)
    return text if seconds <= 0 else "+" + text


def interval_text(d: Paired) -> str:
    """"95% interval lo to hi ms", or why there is none."""
    if d.interval_s is None:
        return f"no 95% interval from {d.rounds} rounds; it needs {fewest_rounds_for_an_interval()}"
    return f"95% interval {fmt.ms_interval(d.interval_s)} ms"


def difference_clause(d: Paired) -> str:
    """The comparison in words, chosen by the interval.

    "a's step is 12.3 ms longer than b's (median of per-round differences +12.3 ms, 95% interval
    4.10 to 20.2 ms)", or "a and b are indistinguishable here (a − b per round: +2.00 ms, 95%
    interval -1.00 to 4.00 ms)".
    """
    if d.resolved:
        word = "longer" if d.median_s > 0 else "shorter"
        return (f"{d.a}'s {d.what} is {fmt.ms(abs(d.median_s))} ms {word} than {d.b}'s (median of per-round "
                f"differences {signed_ms(d.median_s)} ms, {interval_text(d)})")
    if d.interval_s is None:
        return f"{d.a} − {d.b} per round ({d.what}): {signed_ms(d.median_s)} ms ({interval_text(d)}, so no verdict)"
    subject = f"{d.a} and {d.b}" if d.what == "step" else f"{d.a}'s and {d.b}'s {d.what}"
    return (f"{subject} are {INDISTINGUISHABLE} ({d.a} − {d.b} per round: {signed_ms(d.median_s)} ms, "
            f"{interval_text(d)})")


PAIRED_HEADERS = ["comparison (step of a − step of b, per round)", "median difference (ms)", "95% interval (ms)",
                  "reading"]


def paired_table(differences: Iterable[Paired]) -> str:
    """One row per comparison: the median per-round difference, its interval, and what it says."""
    rows = [[f"{d.a} − {d.b}" + ("" if d.what == "step" else f" ({d.what})"), signed_ms(d.median_s), fmt.ms_interval(d.interval_s), d.reading]
            for d in differences]
    return fmt.table(PAIRED_HEADERS, rows, align="lrrl")


def listed(parts: list[str]) -> str:
    """"x", "x and y", "x, y and z"."""
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]
