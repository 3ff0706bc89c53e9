"""Problem 6a as values: the bucket sweep's paired comparisons and which of them exclude zero.

The verdict (does the sweep match the expected U shape between per-parameter and flat?) follows
from the intervals, never from the medians' order; the template words it.
"""

from __future__ import annotations

import statistics

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.writeup.paired import Paired, paired

REFERENCES = (TORCH_DDP, "per-parameter", "flat")
CONFIDENCE = 0.95  # of every paired interval (paired.py): 1 comparison in 20 resolves by chance alone


def comparisons(sweep: list[StepRecord], v: dict[str, StepRecord]) -> list[Paired]:
    """Each size against the next larger one, then every size against torch DDP, per-parameter and flat."""
    out = [paired(b, a) for a, b in zip(sweep, sweep[1:])]
    return out + [paired(r, v[ref]) for ref in REFERENCES if ref in v for r in sweep]


def _same_buckets(a: StepRecord, b: StepRecord) -> bool:
    return bool(a.bucket_bytes) and a.bucket_bytes == b.bucket_bytes


def sweep_verdict(sweep: list[StepRecord], v: dict[str, StepRecord], differences: list[Paired]) -> dict:
    """Which neighbouring sizes are told apart, which sizes beat flat and per-parameter (resolved), the
    word ("yes": a size below the largest, so short of flat-like, beats both; "in part": some size beats one;
    "no"), and the noise: median interval width against median difference.

    A size whose win is not shared by a size that built the same buckets (the same experiment run
    twice) is ``lone``, not a finding: with ``n`` comparisons at 95%, about ``n / 20`` resolve by chance."""
    adjacent = differences[:max(len(sweep) - 1, 0)]
    resolved = {ref: [r for r in sweep if (d := paired(r, v[ref])).resolved and d.median_s < 0]
                for ref in ("flat", "per-parameter") if ref in v}
    lone = {ref: [(r, [x for x in sweep if x is not r and _same_buckets(x, r) and x not in found]) for r in found]
            for ref, found in resolved.items()}
    lone = {ref: [(r, twins) for r, twins in pairs if twins] for ref, pairs in lone.items()}
    beats = {ref: [r for r in found if r not in [x for x, _ in lone[ref]]] for ref, found in resolved.items()}
    middle = [r for r in sweep[:-1] if all(r in b for b in beats.values())] if len(beats) == 2 else []
    with_interval = [d for d in differences if d.interval_s is not None]
    noise = dict(unresolved=sum(not d.resolved for d in with_interval), n=len(with_interval),
                 width=statistics.median(d.interval_s[1] - d.interval_s[0] for d in with_interval if d.interval_s),
                 size=statistics.median(abs(d.median_s) for d in with_interval),
                 rounds=with_interval[0].rounds, by_chance=(1 - CONFIDENCE) * len(with_interval)) if with_interval else None
    return dict(adjacent=len(adjacent), told_apart=[d for d in adjacent if d.resolved], beats=beats, noise=noise,
                lone={ref: pairs for ref, pairs in lone.items() if pairs},
                word="yes" if middle else "in part" if any(beats.values()) else "no", middle=middle)
