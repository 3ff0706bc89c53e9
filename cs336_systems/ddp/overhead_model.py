"""A model of bucketed DDP's exposed communication (problem 6b), and its fit to measurements.

Vocabulary (fixed for this module):

* ``s``: bytes of gradient to all-reduce per step (4 x parameters in float32);
* ``n_b``: number of buckets; ``b_k`` the payload of bucket ``k`` in launch order;
* ``w``: all-reduce bandwidth in bytes per second (algbw: payload bytes / time);
* ``o``: fixed cost of one all-reduce call, in seconds, whatever its payload;
* ``B``: how long backward computes;
* one all-reduce of ``b`` bytes takes ``o + b / w`` and calls run one after another on a
  single communication channel, so their fixed costs queue up.

The recursion (:func:`bucket_finish_times`): bucket ``k`` is ready at ``r_k`` (when backward
has produced its last gradient) and its all-reduce starts when both it and the channel are
free, ``f_k = max(r_k, f_{k-1}) + o + b_k / w``; the time left exposed after backward is
``f_{n_b} - B``. :func:`predicted_wait` applies it to the buckets a wrapper actually built,
with backward producing gradient bytes at a constant rate over a measured ``B``.

The closed form (:func:`exposed_overhead`) is the special case of ``n_b`` equal buckets and a
backward exactly as fast as the channel (``B = s / w``, so filling one bucket takes
``s / (w n_b)``, without the ``o``: backward's length is the model's compute, whatever the
bucketing). Then ``T(n_b) = o n_b + s / (w n_b)``, minimised at ``n_b* = sqrt(s / (w o))``
buckets of ``sqrt(s w o)`` bytes, where ``T = 2 sqrt(s o / w)``. The derivation is written out
in the writeup (``cs336_systems/writeup/overhead_section.py``) and both are checked against a
simulation of the channel in ``tests/test_overhead_model.py``. Everything here is pure
arithmetic on floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _check_line_data(x: np.ndarray, y: np.ndarray) -> None:
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"need two 1-d sequences of equal length, got shapes {x.shape} and {y.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"a line needs at least two distinct payload sizes, got {sorted(set(x.tolist()))}")
    if not np.all(y > 0):
        raise ValueError(f"times must be > 0 seconds, got {y.tolist()}")


def _relative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) minimising ``sum(((y - a - b x) / y)^2)``."""
    design = np.stack([np.ones_like(x), x], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design / y[:, None], np.ones_like(y), rcond=None)
    return float(intercept), float(slope)


def relative_r2(payload_bytes: Sequence[float], seconds: Sequence[float], o: float, w: float) -> float:
    """R² of ``seconds ~ o + bytes / w`` on the residuals the fit minimises: relative ones.

    The relative fit is weighted least squares with weights ``1 / t^2``, so its R² is the
    weighted one: ``1 - sum(((t - o - x/w) / t)^2) / sum(((t - t_w) / t)^2)``, where
    ``t_w = sum(1/t) / sum(1/t^2)`` is the weighted mean time (the best constant under the same
    weights). 1 is a perfect line; 0 is no better than that constant.
    """
    x = np.asarray(payload_bytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    residual = (y - o - x / w) / y
    mean = np.sum(1 / y) / np.sum(1 / y**2)
    total = float(np.sum(((y - mean) / y) ** 2))
    return 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0


def fit_latency_bandwidth(
    payload_bytes: Sequence[float], seconds: Sequence[float]
) -> tuple[float, float, float]:
    """Least-squares fit of ``seconds = o + payload_bytes / w``; returns ``(o_s, w_bytes_per_s, r2)``.

    A straight line in the payload: intercept ``o`` (the per-call cost) and slope ``1 / w``.
    The residuals are taken relative to each measured time, i.e. ``sum(((t - o - x/w) / t)^2)``
    is minimised. Benchmark payloads are spaced by decades (1 MB ... 1 GB): with plain residuals
    the largest payload's run-to-run noise (tens of ms) swamps the per-call cost (about a ms),
    and the intercept comes out at the mercy of that noise, even negative. Relative residuals
    give every payload the same say, which is what the measurement noise looks like (a few
    percent of each time). ``r2`` is :func:`relative_r2`, on those same relative residuals.
    The intercept is reported as fitted, so it can still come out negative when the per-call
    cost is below what the data can resolve; callers decide what to do with that.
    """
    x = np.asarray(payload_bytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    _check_line_data(x, y)
    intercept, slope = _relative_fit(x, y)
    if slope <= 0:
        raise ValueError(
            f"time does not grow with payload (fitted slope {slope:.3g} s/byte): no bandwidth to fit"
        )
    return intercept, 1.0 / slope, relative_r2(x, y, intercept, 1.0 / slope)


@dataclass(frozen=True)
class FitIntervals:
    """Bootstrap percentile intervals of the fitted ``o`` and ``w``."""

    o_s: tuple[float, float]
    w_bytes_per_s: tuple[float, float]
    resamples: int  # resamples drawn
    fitted: int  # of which gave a line with a positive slope (the others are left out)


def bootstrap_latency_bandwidth(
    payload_bytes: Sequence[float],
    times_s: Sequence[Sequence[float]],
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> FitIntervals:
    """Intervals on ``o`` and ``w`` from resampling each payload's timed iterations.

    Each resample draws, for every payload, as many iteration times as were measured, with
    replacement, takes their median (as the benchmark does) and refits the line. The interval
    is the central ``confidence`` share of the refitted values. ``seed`` makes it reproducible:
    the same timings always give the same interval.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if len(payload_bytes) != len(times_s) or any(len(t) == 0 for t in times_s):
        raise ValueError("need one non-empty list of iteration times per payload")
    x = np.asarray(payload_bytes, dtype=np.float64)
    _check_line_data(x, np.array([float(np.median(t)) for t in times_s]))
    rng = np.random.default_rng(seed)
    medians = np.stack([np.median(rng.choice(np.asarray(t, dtype=np.float64), size=(resamples, len(t))), axis=1)
                        for t in times_s], axis=1)  # [resample, payload]
    o_values, w_values = [], []
    for y in medians:
        intercept, slope = _relative_fit(x, y)
        if slope > 0:
            o_values.append(intercept)
            w_values.append(1.0 / slope)
    if not o_values:
        raise ValueError("no resample gave a time that grows with the payload: no bandwidth to fit")
    tail = 100 * (1 - confidence) / 2
    o_low, o_high = np.percentile(o_values, [tail, 100 - tail]).tolist()
    w_low, w_high = np.percentile(w_values, [tail, 100 - tail]).tolist()
    return FitIntervals((o_low, o_high), (w_low, w_high), resamples, len(o_values))


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_overhead(o: float) -> None:
    if o < 0:
        raise ValueError(f"per-call overhead o must be >= 0, got {o!r}")


def bucket_finish_times(
    ready_s: Sequence[float], bucket_bytes: Sequence[float], w: float, o: float
) -> list[float]:
    """``f_k = max(r_k, f_{k-1}) + o + b_k / w`` for buckets in launch order (``f_0 = 0``)."""
    _check_positive(w=w)
    _check_overhead(o)
    if len(ready_s) != len(bucket_bytes) or not bucket_bytes:
        raise ValueError(f"need one ready time per bucket, got {len(ready_s)} for {len(bucket_bytes)} buckets")
    finish, channel_free = [], 0.0
    for ready, size in zip(ready_s, bucket_bytes):
        channel_free = max(ready, channel_free) + o + size / w
        finish.append(channel_free)
    return finish


def proportional_ready_times(bucket_bytes: Sequence[float], backward_s: float) -> list[float]:
    """When each bucket is ready if backward produces gradient bytes at a constant rate over
    ``backward_s``: ``r_k = B (b_1 + ... + b_k) / s``. The last bucket is ready as backward ends."""
    _check_positive(backward_s=backward_s)
    total = float(sum(bucket_bytes))
    _check_positive(total_bytes=total)
    done, ready = 0.0, []
    for size in bucket_bytes:
        done += size
        ready.append(backward_s * done / total)
    return ready


def predicted_wait(bucket_bytes: Sequence[float], backward_s: float, w: float, o: float) -> float:
    """Seconds from the end of backward to the end of the last all-reduce, by the recursion,
    for these buckets (payloads in launch order) and a backward of ``backward_s``."""
    ready = proportional_ready_times(bucket_bytes, backward_s)
    return bucket_finish_times(ready, bucket_bytes, w, o)[-1] - backward_s


def exposed_overhead(s: float, w: float, o: float, n_b: float) -> float:
    """Seconds from the end of backward to the end of the last bucket's all-reduce: ``o n_b + s/(w n_b)``.

    The closed form for ``n_b`` equal buckets and ``B = s / w``. ``n_b`` may be any positive
    real (the continuous relaxation used to find the optimum).
    """
    _check_positive(s=s, w=w, n_b=n_b)
    _check_overhead(o)
    return o * n_b + s / (w * n_b)


def optimal_bucket_count(s: float, w: float, o: float) -> float:
    """The real ``n_b`` minimising :func:`exposed_overhead`: ``sqrt(s / (w o))``.

    ``dT/dn_b = o - s / (w n_b^2)`` vanishes there and ``d2T/dn_b2 = 2 s / (w n_b^3) > 0``.
    With ``o == 0`` every extra bucket is free and the optimum is ``inf``.
    """
    _check_positive(s=s, w=w)
    _check_overhead(o)
    if o == 0:
        return math.inf
    return math.sqrt(s / (w * o))


def optimal_bucket_bytes(s: float, w: float, o: float, largest_param_bytes: float) -> float:
    """The bucket cap the closed form asks for: ``sqrt(s w o)``, at most ``s`` (one bucket).

    The cap may be below the largest parameter: a parameter is never split, so only the
    bucket holding the largest parameter must be at least ``p_max``, and it then travels
    alone while the others are filled up to the cap. ``largest_param_bytes`` matters only when
    ``o == 0``: the model then asks for infinitely many buckets, and the cap stops at ``p_max``
    (below it the largest parameter's bucket shrinks no further).
    """
    _check_positive(s=s, w=w, largest_param_bytes=largest_param_bytes)
    if largest_param_bytes > s:
        raise ValueError(
            f"largest parameter ({largest_param_bytes:g} bytes) cannot exceed all gradients ({s:g} bytes)"
        )
    n_b = optimal_bucket_count(s, w, o)
    return largest_param_bytes if math.isinf(n_b) else min(s / n_b, s)


def minimum_exposed_overhead(s: float, w: float, o: float) -> float:
    """``T(n_b*) = 2 sqrt(s o / w)``: both terms of the overhead are equal at the optimum."""
    _check_positive(s=s, w=w)
    _check_overhead(o)
    return 2.0 * math.sqrt(s * o / w)
