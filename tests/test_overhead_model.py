"""Problem 6b: the bucketed-DDP overhead model, checked against references that share no code with it.

* the fit must recover a per-call cost and bandwidth planted in synthetic timings;
* the closed-form optimum must match a brute-force search over bucket counts;
* the derivation's queueing claim is replayed by a discrete-event simulation of one channel;
* the bucket size must respect the two limits a bucketing has (largest parameter, everything).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cs336_systems.ddp.overhead_model import (
    exposed_overhead,
    fit_latency_bandwidth,
    minimum_exposed_overhead,
    optimal_bucket_bytes,
    optimal_bucket_count,
)

pytestmark = pytest.mark.problem("ddp_bucketed_benchmarking")

MB = 2**20


def test_fit_recovers_planted_latency_and_bandwidth():
    o, w = 120e-6, 3.5e9  # 120 µs per call, 3.5 GB/s
    payloads = np.array([2**k for k in range(12, 30, 2)], dtype=float)
    rng = np.random.default_rng(0)
    # 0.5% multiplicative noise: a fit that weights all points alike still sees the line.
    seconds = (o + payloads / w) * (1 + 0.005 * rng.standard_normal(payloads.size))
    o_fit, w_fit, r2 = fit_latency_bandwidth(payloads, seconds)
    assert w_fit == pytest.approx(w, rel=0.02)
    assert o_fit == pytest.approx(o, rel=0.25)
    assert 0.999 < r2 <= 1.0


def test_fit_is_exact_on_noiseless_data():
    payloads = [1e3, 1e5, 1e7]
    o_fit, w_fit, r2 = fit_latency_bandwidth(payloads, [2e-3 + p / 1e9 for p in payloads])
    assert (o_fit, w_fit, r2) == pytest.approx((2e-3, 1e9, 1.0), rel=1e-9)


@pytest.mark.parametrize(
    "payloads, seconds, message",
    [
        ([1e6, 1e6], [1.0, 2.0], "two distinct payload sizes"),
        ([1e3, 1e6], [2.0, 1.0], "does not grow with payload"),
        ([1e3, 1e6], [1.0], "equal length"),
    ],
)
def test_fit_rejects_data_without_a_line(payloads, seconds, message):
    with pytest.raises(ValueError, match=message):
        fit_latency_bandwidth(payloads, seconds)


@pytest.mark.parametrize("s, w, o", [(100 * MB, 10e9, 50e-6), (5 * MB, 0.6e9, 700e-6), (4e9, 200e9, 20e-6)])
def test_closed_form_optimum_matches_a_numeric_search(s, w, o):
    counts = np.geomspace(1e-2, 1e6, 400_001)  # a fine grid over eight decades of bucket counts
    values = o * counts + s / (w * counts)  # T(n_b), written out again rather than reused
    best = counts[np.argmin(values)]
    assert optimal_bucket_count(s, w, o) == pytest.approx(best, rel=1e-4)
    assert minimum_exposed_overhead(s, w, o) == pytest.approx(values.min(), rel=1e-8)
    assert exposed_overhead(s, w, o, optimal_bucket_count(s, w, o)) == pytest.approx(values.min(), rel=1e-8)


def simulate_channel(s: float, w: float, o: float, n_b: int) -> float:
    """Exposed time after backward, by replaying events: bucket k is ready at k*c and each
    all-reduce occupies the single channel for o + c, starting when both it and the channel are."""
    c = s / (w * n_b)
    channel_free = 0.0
    for k in range(1, n_b + 1):
        ready = k * c
        start = max(ready, channel_free)
        channel_free = start + o + c
    backward_end = n_b * c
    return channel_free - backward_end


@pytest.mark.parametrize("n_b", [1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("o", [0.0, 15e-6, 2e-3])
def test_queueing_simulation_gives_the_derived_overhead(n_b, o):
    s, w = 48 * MB, 12e9
    assert simulate_channel(s, w, o, n_b) == pytest.approx(o * n_b + s / (w * n_b), rel=1e-12, abs=1e-15)
    assert exposed_overhead(s, w, o, n_b) == pytest.approx(simulate_channel(s, w, o, n_b), rel=1e-12, abs=1e-15)


def test_bucket_size_is_sqrt_swo_inside_the_limits():
    s, w, o = 400 * MB, 25e9, 40e-6
    unconstrained = math.sqrt(s * w * o)
    assert 1 * MB < unconstrained < s
    assert optimal_bucket_bytes(s, w, o, largest_param_bytes=1 * MB) == pytest.approx(unconstrained)


def test_bucket_size_is_clamped_to_the_largest_parameter_and_to_everything():
    s, w = 400 * MB, 25e9
    tiny_o, huge_o = 1e-9, 10.0
    largest = 30 * MB
    assert math.sqrt(s * w * tiny_o) < largest
    assert optimal_bucket_bytes(s, w, tiny_o, largest) == largest
    assert math.sqrt(s * w * huge_o) > s
    assert optimal_bucket_bytes(s, w, huge_o, largest) == s
    # No per-call cost: more buckets are always better, down to the largest parameter.
    assert optimal_bucket_count(s, w, 0.0) == math.inf
    assert optimal_bucket_bytes(s, w, 0.0, largest) == largest


def test_clamped_size_beats_every_feasible_bucket_count():
    s, w, o, largest = 256 * MB, 2e9, 3e-3, 64 * MB  # unconstrained optimum lies below the limit
    best = optimal_bucket_bytes(s, w, o, largest)
    feasible = [s / n for n in range(1, 5)]  # at most s / largest = 4 buckets
    assert exposed_overhead(s, w, o, s / best) <= min(exposed_overhead(s, w, o, s / b) for b in feasible) + 1e-15


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: exposed_overhead(0, 1e9, 1e-5, 4), "s must be > 0"),
        (lambda: exposed_overhead(1e6, 1e9, -1e-5, 4), "o must be >= 0"),
        (lambda: optimal_bucket_count(1e6, 0, 1e-5), "w must be > 0"),
        (lambda: optimal_bucket_bytes(1e6, 1e9, 1e-5, 2e6), "cannot exceed all gradients"),
    ],
)
def test_bad_arguments_name_the_broken_invariant(call, message):
    with pytest.raises(ValueError, match=message):
        call()
