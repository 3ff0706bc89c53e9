"""Problem 6b: the bucketed-DDP overhead model, checked against references that share no code with it.

* the fit must recover a per-call cost and bandwidth planted in synthetic timings, agree with
  numpy's weighted polynomial fit, and its R² be the one on the residuals it minimises;
* bootstrap intervals must cover the planted o and w;
* the closed-form optimum must match a brute-force search over bucket counts;
* the derivation's queueing claim, and the recursion on unequal buckets with any backward, are
  replayed by hand-computed cases and by a time-stepped simulation of one channel;
* the bucket size must respect the one upper limit (everything in one bucket) and may go below
  the largest parameter (only that parameter's bucket must hold it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cs336_systems.ddp.overhead_model import (
    bootstrap_latency_bandwidth,
    bucket_finish_times,
    exposed_overhead,
    fit_latency_bandwidth,
    minimum_exposed_overhead,
    optimal_bucket_bytes,
    optimal_bucket_count,
    predicted_wait,
    proportional_ready_times,
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


def test_bucket_size_may_go_below_the_largest_parameter_but_not_above_everything():
    s, w = 400 * MB, 25e9
    tiny_o, huge_o = 1e-9, 10.0
    largest = 30 * MB
    # Only the largest parameter's bucket must hold it: the model's smaller cap stands.
    assert math.sqrt(s * w * tiny_o) < largest
    assert optimal_bucket_bytes(s, w, tiny_o, largest) == pytest.approx(math.sqrt(s * w * tiny_o))
    assert optimal_bucket_bytes(s, w, huge_o, largest) == s
    # No per-call cost: more buckets are always better, and the cap stops at the largest parameter.
    assert optimal_bucket_count(s, w, 0.0) == math.inf
    assert optimal_bucket_bytes(s, w, 0.0, largest) == largest


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


# -- the fit's R² and its uncertainty ---------------------------------------------------------

def test_fit_matches_numpys_weighted_fit_and_r2_is_on_relative_residuals():
    """np.polyfit with weights 1/t minimises the same sum of squared relative residuals; its
    constant fit (degree 0) is the baseline the relative R² is measured against."""
    payloads = np.array([64e3, 1e6, 16e6, 128e6])
    seconds = np.array([0.9e-3, 2.1e-3, 14.0e-3, 118e-3])
    o_fit, w_fit, r2 = fit_latency_bandwidth(payloads, seconds)
    slope, intercept = np.polyfit(payloads, seconds, 1, w=1 / seconds)
    assert (o_fit, w_fit) == pytest.approx((intercept, 1 / slope), rel=1e-9)
    line_ss = np.sum(((seconds - np.polyval([slope, intercept], payloads)) / seconds) ** 2)
    [constant] = np.polyfit(payloads, seconds, 0, w=1 / seconds)
    constant_ss = np.sum(((seconds - constant) / seconds) ** 2)
    assert r2 == pytest.approx(1 - line_ss / constant_ss, rel=1e-9)
    # Not the plain R² on seconds, which the largest payload would dominate.
    plain = 1 - np.sum((seconds - np.polyval([slope, intercept], payloads)) ** 2) / np.sum((seconds - seconds.mean()) ** 2)
    assert r2 != pytest.approx(plain, rel=1e-6)


def planted_iterations(o: float, w: float, payloads: list[float], iters: int, noise: float, seed: int) -> list[list[float]]:
    """Timed iterations around o + x / w with multiplicative log-normal noise."""
    rng = np.random.default_rng(seed)
    return [list((o + x / w) * np.exp(noise * rng.standard_normal(iters))) for x in payloads]


def test_bootstrap_intervals_cover_the_planted_o_and_w():
    """Over 20 independent data sets, the 95% intervals cover the planted values almost always
    (at least 17 of 20: a coverage below ~85% fails), and each interval holds its own point fit."""
    o, w = 500e-6, 1e9
    payloads = [64e3, 1e6, 16e6, 128e6]
    covered_o = covered_w = 0
    for seed in range(20):
        times = planted_iterations(o, w, payloads, iters=20, noise=0.05, seed=seed)
        iv = bootstrap_latency_bandwidth(payloads, times, resamples=400, seed=seed)
        point_o, point_w, _ = fit_latency_bandwidth(payloads, [float(np.median(t)) for t in times])
        assert iv.o_s[0] <= point_o <= iv.o_s[1] and iv.w_bytes_per_s[0] <= point_w <= iv.w_bytes_per_s[1]
        covered_o += iv.o_s[0] <= o <= iv.o_s[1]
        covered_w += iv.w_bytes_per_s[0] <= w <= iv.w_bytes_per_s[1]
    assert covered_o >= 17 and covered_w >= 17


def test_bootstrap_intervals_narrow_with_less_noise_and_repeat_with_the_seed():
    o, w = 500e-6, 1e9
    payloads = [64e3, 1e6, 16e6, 128e6]
    noisy = bootstrap_latency_bandwidth(payloads, planted_iterations(o, w, payloads, 20, 0.10, 1), resamples=300)
    quiet = bootstrap_latency_bandwidth(payloads, planted_iterations(o, w, payloads, 20, 0.01, 1), resamples=300)
    width = lambda pair: pair[1] - pair[0]  # noqa: E731
    assert width(quiet.w_bytes_per_s) < width(noisy.w_bytes_per_s) / 3
    again = bootstrap_latency_bandwidth(payloads, planted_iterations(o, w, payloads, 20, 0.10, 1), resamples=300)
    assert again == noisy


# -- the recursion on the buckets actually built ----------------------------------------------

def test_recursion_on_hand_computed_cases():
    w = 1.0  # bytes per second, so a bucket's transfer takes its size in seconds
    # Ready at 1, 2, 10 s; transfers of 1, 3, 1 s; o = 0.5 s.
    # f1 = 1 + 1.5 = 2.5; f2 = max(2, 2.5) + 3.5 = 6.0; f3 = max(10, 6) + 1.5 = 11.5.
    assert bucket_finish_times([1, 2, 10], [1, 3, 1], w, 0.5) == pytest.approx([2.5, 6.0, 11.5])
    # Backward of 8 s over buckets of 2, 2, 4 bytes: ready at 2, 4, 8 s. With o = 1:
    # f1 = 2 + 3 = 5; f2 = max(4, 5) + 3 = 8; f3 = max(8, 8) + 5 = 13; wait after backward 13 - 8 = 5.
    assert proportional_ready_times([2, 2, 4], 8.0) == pytest.approx([2.0, 4.0, 8.0])
    assert predicted_wait([2, 2, 4], 8.0, w, 1.0) == pytest.approx(5.0)
    # The same buckets behind a 2 s backward (ready at 0.5, 1, 2 s) queue up:
    # f1 = 0.5 + 3 = 3.5; f2 = max(1, 3.5) + 3 = 6.5; f3 = max(2, 6.5) + 5 = 11.5; wait 11.5 - 2 = 9.5.
    assert predicted_wait([2, 2, 4], 2.0, w, 1.0) == pytest.approx(9.5)


def simulate_in_time_steps(bucket_bytes: list[float], backward_s: float, w: float, o: float, dt: float) -> float:
    """A clock-driven replay, sharing nothing with the recursion: every dt, backward adds its bytes
    (at s / B per second) to the buckets in order; a full bucket joins the channel's queue; the
    channel spends o on each call, then moves w bytes per second. Returns the time the last
    bucket is through, minus backward's end."""
    rate = sum(bucket_bytes) / backward_s
    produced, filled, queue = 0.0, 0, []
    busy_setup, busy_bytes, current = 0.0, 0.0, None
    t, done = 0.0, 0
    while done < len(bucket_bytes):
        produced = min(sum(bucket_bytes), produced + rate * dt)
        while filled < len(bucket_bytes) and produced >= sum(bucket_bytes[: filled + 1]) - 1e-9:
            queue.append(filled)
            filled += 1
        budget = dt
        while budget > 0:
            if current is None:
                if not queue:
                    break
                current = queue.pop(0)
                busy_setup, busy_bytes = o, bucket_bytes[current]
            spend = min(budget, busy_setup)
            busy_setup -= spend
            budget -= spend
            moved = min(budget * w, busy_bytes)
            busy_bytes -= moved
            budget -= moved / w
            if busy_setup <= 0 and busy_bytes <= 1e-12:
                current, done = None, done + 1
        t += dt
    return t - backward_s


@pytest.mark.parametrize("backward_s", [0.02, 0.1, 0.5])
@pytest.mark.parametrize("buckets_mb", [[1, 4, 4, 4, 19.5], [19.5, 2.6, 2.6, 1, 1, 19.5], [40]])
def test_recursion_matches_a_time_stepped_channel(buckets_mb, backward_s):
    w, o, dt = 1e9, 2e-3, 2e-5
    sizes = [b * MB for b in buckets_mb]
    expected = simulate_in_time_steps(sizes, backward_s, w, o, dt)
    assert predicted_wait(sizes, backward_s, w, o) == pytest.approx(expected, abs=3 * dt)


@pytest.mark.parametrize("n_b", [1, 3, 16])
def test_equal_buckets_and_a_channel_paced_backward_give_the_closed_form(n_b):
    s, w, o = 48 * MB, 12e9, 150e-6
    assert predicted_wait([s / n_b] * n_b, s / w, w, o) == pytest.approx(exposed_overhead(s, w, o, n_b), rel=1e-12)


def test_the_two_regimes():
    w, o = 1e9, 1e-3
    sizes = [19.5 * MB, 5 * MB, 5 * MB, 5 * MB, 19.5 * MB]
    channel = len(sizes) * o + sum(sizes) / w
    # Compute-bound: every bucket finds the channel free; only the last one's transfer shows.
    assert predicted_wait(sizes, 20 * channel, w, o) == pytest.approx(o + sizes[-1] / w, rel=1e-12)
    # Communication-bound: the queue shows, at least the channel's busy time beyond backward.
    short = channel / 5
    assert predicted_wait(sizes, short, w, o) >= channel - short
