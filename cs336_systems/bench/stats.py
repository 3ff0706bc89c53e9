"""Comparing two variants timed in the same interleaved run, round by round.

The DDP step benchmark runs every variant once per round, one round after another, so step
``i`` of one variant and step ``i`` of another ran seconds apart, under the same machine load.
On a shared 2-core machine the load drifts by far more than the differences we look for (the
compute-only step alone can range over hundreds of ms), so a difference of two medians taken
over all rounds mixes the drift in. The difference *within* each round cancels most of it:
we report the median of the per-round differences, and judge it against a distribution-free
confidence interval for that median (the sign-test interval: order statistics chosen from the
binomial distribution, e.g. Conover, *Practical Nonparametric Statistics*, 3rd ed., sec. 3.2),
which assumes nothing about the shape of the noise, only that rounds are independent.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] - b[i]`` for each round ``i``; both must come from the same rounds."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths (one per round), got {len(a)} and {len(b)}")
    return [x - y for x, y in zip(a, b)]


def round_means(values: Sequence[float], steps_per_round: int) -> list[float]:
    """The mean of each round's consecutive ``steps_per_round`` values: the unit of pairing is the
    round (steps of one round are timed back to back, so they share its load and are not independent)."""
    if steps_per_round < 1 or len(values) % steps_per_round:
        raise ValueError(f"{len(values)} steps do not split into rounds of {steps_per_round}")
    return [statistics.fmean(values[i:i + steps_per_round]) for i in range(0, len(values), steps_per_round)]


def _binomial_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def one_side_chance(n: int, confidence: float = 0.95) -> float | None:
    """The chance that :func:`median_interval` of ``n`` values lies wholly above (or wholly below)
    a median that is in fact zero: ``P(Binomial(n, 1/2) <= k - 1)``, at most ``(1 - confidence) / 2``
    and, n being whole, often well below it (16 values: 0.0106, not 0.025). None without an interval."""
    tail = (1 - confidence) / 2
    k = 0
    while k < n // 2 and _binomial_cdf_half(k, n) <= tail:
        k += 1
    return _binomial_cdf_half(k - 1, n) if k else None


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A confidence interval for the median of ``values``, or None if too few for that confidence.

    The interval is ``[x_(k), x_(n-k+1)]`` of the sorted values, with ``k`` the largest order
    such that ``P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2``: it covers the median
    with probability at least ``confidence`` whatever the distribution. At 95% it needs n >= 6.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    n = len(values)
    tail = (1 - confidence) / 2
    k = 0
    while k < n // 2 and _binomial_cdf_half(k, n) <= tail:
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_median(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, steps_per_round: int = 1
) -> tuple[float, tuple[float, float] | None]:
    """(median over rounds of ``a - b``, its confidence interval or None); ``a`` and ``b`` hold
    ``steps_per_round`` steps per round, averaged within each round before pairing."""
    differences = paired_differences(round_means(a, steps_per_round), round_means(b, steps_per_round))
    if not differences:
        raise ValueError("no rounds to compare")
    return statistics.median(differences), median_interval(differences, confidence)
