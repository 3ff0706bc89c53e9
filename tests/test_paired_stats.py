"""The round-by-round comparison behind every exposed overhead: paired differences and the
distribution-free interval for their median, checked against binomial arithmetic done here
and against a simulation of its coverage."""

from __future__ import annotations

import random

import pytest

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.stats import median_interval, paired_differences, paired_median, round_means

pytestmark = pytest.mark.problem("ddp_bucketed_benchmarking")


def test_differences_are_taken_round_by_round():
    assert paired_differences([5.0, 7.0, 9.0], [1.0, 2.0, 3.0]) == [4.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="equal lengths"):
        paired_differences([1.0, 2.0], [1.0])


def test_a_round_of_several_steps_counts_once():
    # 6 rounds of 2 steps: pairing the 12 steps would claim 12 rounds and an interval from the 3rd
    # to the 10th of them; the rounds' means give 6 differences and the min..max interval.
    a = [3.0, 5.0, 2.0, 2.0, 9.0, 1.0, 4.0, 4.0, 6.0, 2.0, 3.0, 3.0]
    b = [0.0] * 12
    assert round_means(a, 2) == [4.0, 2.0, 5.0, 4.0, 4.0, 3.0]
    assert paired_median(a, b, steps_per_round=2) == (4.0, (2.0, 5.0))
    with pytest.raises(ValueError, match="do not split into rounds of 5"):
        round_means(a, 5)
    steps = StepRecord.from_steps("naive", a, b, 1, steps_per_round=2)
    assert (steps.exposed_overhead_s, steps.exposed_overhead_ci95_s, steps.steps_per_round) == (4.0, [2.0, 5.0], 2)
    # A file from before the field paired single steps; regrouped() pairs its rounds.
    old = StepRecord.from_steps("naive", a, b, 1)
    assert old.regrouped(2, b) == steps


@pytest.mark.parametrize(
    "n, orders",
    [
        (5, None),  # even min..max covers the median with only 1 - 2/32 = 93.75%
        (6, (1, 6)),  # 1 - 2/64 = 96.9%
        (8, (1, 8)),  # P(X <= 1) = 9/256 = 3.5% > 2.5%, so not (2, 7)
        (9, (2, 8)),  # P(X <= 1) = 10/512 = 1.95%
        (16, (4, 13)),  # P(X <= 3) = 697/65536 = 1.06%, P(X <= 4) = 2517/65536 = 3.8%
    ],
)
def test_interval_uses_the_binomial_order_statistics(n, orders):
    values = [float(10 * i) for i in range(n, 0, -1)]  # unsorted on purpose: 10*n .. 10
    interval = median_interval(values)
    if orders is None:
        assert interval is None
    else:
        lo, hi = orders
        assert interval == (10.0 * lo, 10.0 * hi)


def test_interval_covers_the_median_at_least_as_often_as_promised():
    rng = random.Random(0)
    trials, covered = 4000, 0
    for _ in range(trials):
        # Skewed noise (exponential), true median ln 2.
        sample = [rng.expovariate(1.0) for _ in range(16)]
        lo, hi = median_interval(sample)
        covered += lo <= 0.6931471805599453 <= hi
    assert covered / trials >= 0.95


def test_paired_median_cancels_drift_shared_by_both_variants():
    drift = [0.0, 0.4, 0.1, 0.9, 0.2, 0.5, 0.3, 0.8]  # the machine's load, round by round
    floor = [1.0 + d for d in drift]
    variant = [1.05 + d for d in drift]
    median, interval = paired_median(variant, floor)
    assert median == pytest.approx(0.05)
    assert interval == pytest.approx((0.05, 0.05))


def test_confidence_must_be_a_probability():
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], confidence=1.5)
