"""A model of bucketed DDP's exposed communication (problem 6b), and its fit to measurements.

Vocabulary (fixed for this module):

* ``s``: bytes of gradient to all-reduce per step (4 x parameters in float32);
* ``n_b``: number of buckets; every bucket holds ``s / n_b`` bytes;
* ``w``: all-reduce bandwidth in bytes per second (algbw: payload bytes / time);
* ``o``: fixed cost of one all-reduce call, in seconds, whatever its payload;
* one all-reduce of ``b`` bytes takes ``o + b / w`` and calls run one after another on a
  single communication channel, so their fixed costs queue up.

Backward is assumed to produce gradients at the rate the channel moves them: the compute
that fills one bucket takes as long as that bucket's transfer, ``s / (w n_b)``. Under these
assumptions the time from the end of backward to the end of the last all-reduce is

    T(n_b) = o * n_b + s / (w * n_b),

minimised at ``n_b* = sqrt(s / (w o))`` buckets, i.e. buckets of ``sqrt(s w o)`` bytes,
where ``T = 2 sqrt(s o / w)``. The derivation is written out in the generated writeup
(``cs336_systems/writeup/sections.py``) and checked against a simulation of the channel in
``tests/test_overhead_model.py``. Everything here is pure arithmetic on floats.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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
    percent of each time). ``r2`` is the coefficient of determination on ``seconds`` (1 for a
    perfect fit). The intercept is reported as fitted, so it can still come out negative when
    the per-call cost is below what the data can resolve; callers decide what to do with that.
    """
    x = np.asarray(payload_bytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"need two 1-d sequences of equal length, got shapes {x.shape} and {y.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"a line needs at least two distinct payload sizes, got {sorted(set(x.tolist()))}")
    if not np.all(y > 0):
        raise ValueError(f"times must be > 0 seconds, got {y.tolist()}")
    design = np.stack([np.ones_like(x), x], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design / y[:, None], np.ones_like(y), rcond=None)
    if slope <= 0:
        raise ValueError(
            f"time does not grow with payload (fitted slope {slope:.3g} s/byte): no bandwidth to fit"
        )
    residual = y - design @ np.array([intercept, slope])
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0
    return float(intercept), float(1.0 / slope), r2


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def exposed_overhead(s: float, w: float, o: float, n_b: float) -> float:
    """Seconds from the end of backward to the end of the last bucket's all-reduce: ``o n_b + s/(w n_b)``.

    ``n_b`` may be any positive real (the continuous relaxation used to find the optimum).
    """
    _check_positive(s=s, w=w, n_b=n_b)
    if o < 0:
        raise ValueError(f"per-call overhead o must be >= 0, got {o!r}")
    return o * n_b + s / (w * n_b)


def optimal_bucket_count(s: float, w: float, o: float) -> float:
    """The real ``n_b`` minimising :func:`exposed_overhead`: ``sqrt(s / (w o))``.

    ``dT/dn_b = o - s / (w n_b^2)`` vanishes there and ``d2T/dn_b2 = 2 s / (w n_b^3) > 0``.
    With ``o == 0`` every extra bucket is free and the optimum is ``inf``.
    """
    _check_positive(s=s, w=w)
    if o < 0:
        raise ValueError(f"per-call overhead o must be >= 0, got {o!r}")
    if o == 0:
        return math.inf
    return math.sqrt(s / (w * o))


def optimal_bucket_bytes(s: float, w: float, o: float, largest_param_bytes: float) -> float:
    """Bucket size minimising the exposed overhead, within what a bucketing can achieve.

    Unconstrained, ``s / n_b* = sqrt(s w o)``. A parameter is never split across buckets, so no
    bucket is smaller than the largest parameter; and one bucket holding everything is the
    largest possible. Written in the bucket size ``b = s / n_b`` the overhead is
    ``T(b) = o s / b + b / w``, convex in ``b``, so clamping to ``[largest_param_bytes, s]``
    gives the constrained optimum.
    """
    _check_positive(s=s, w=w, largest_param_bytes=largest_param_bytes)
    if largest_param_bytes > s:
        raise ValueError(
            f"largest parameter ({largest_param_bytes:g} bytes) cannot exceed all gradients ({s:g} bytes)"
        )
    n_b = optimal_bucket_count(s, w, o)
    unconstrained = s / n_b  # 0.0 when n_b is inf
    return min(max(unconstrained, largest_param_bytes), s)


def minimum_exposed_overhead(s: float, w: float, o: float) -> float:
    """``T(n_b*) = 2 sqrt(s o / w)``: both terms of the overhead are equal at the optimum."""
    _check_positive(s=s, w=w)
    if o < 0:
        raise ValueError(f"per-call overhead o must be >= 0, got {o!r}")
    return 2.0 * math.sqrt(s * o / w)
