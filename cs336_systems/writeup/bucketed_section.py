"""Problem 6a as values: the bucket sweep's paired comparisons and which of them exclude zero.

The verdict (does the sweep match the expected U shape between per-parameter and flat?) follows
from the intervals, never from the medians' order; the template words it. One rule for multiple
comparisons, applied to every comparison alike: each resolved interval counts, and the page says
how many wins in one direction the whole family of comparisons would show by chance alone
(``one_side_chance`` per comparison, summed: the sign test's actual error, not a nominal 5%).
"""

from __future__ import annotations

import statistics

from cs336_systems.bench.stats import one_side_chance
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.writeup.paired import Paired, by_chance, paired

REFERENCES = (TORCH_DDP, "per-parameter", "flat")


def comparisons(sweep: list[StepRecord], v: dict[str, StepRecord], unfit: str | None = None) -> list[Paired]:
    """Each size against the next larger one, then every size against torch DDP, per-parameter and flat."""
    out = [paired(b, a, unfit) for a, b in zip(sweep, sweep[1:])]
    return out + [paired(r, v[ref], unfit) for ref in REFERENCES if ref in v for r in sweep]


def _same_buckets(a: StepRecord, b: StepRecord) -> bool:
    return bool(a.bucket_bytes) and a.bucket_bytes == b.bucket_bytes


def sweep_verdict(sweep: list[StepRecord], v: dict[str, StepRecord], differences: list[Paired],
                  unfit: str | None = None) -> dict:
    """Which neighbouring sizes are told apart, which sizes beat flat and per-parameter (resolved), the
    word ("yes": a size below the largest, so short of flat-like, beats both; else "no", the
    sizes that beat one reference still listed; None when the run's times are not evidence, ``unfit`` saying why), the noise (how many comparisons stay unresolved), the wins expected by chance over all of
    them, and the sizes that built the same buckets as another yet disagree with it against a reference
    (the same plan measured twice: a fact the page states beside the chance, not a discount)."""
    adjacent = differences[:max(len(sweep) - 1, 0)]
    beats = {ref: [r for r in sweep if (d := paired(r, v[ref], unfit)).resolved and d.median_s < 0]
             for ref in ("flat", "per-parameter") if ref in v}
    twins = {ref: [(r, [x for x in sweep if x is not r and _same_buckets(x, r) and x not in found]) for r in found]
             for ref, found in beats.items()}
    twins = {ref: [(r, t) for r, t in pairs if t] for ref, pairs in twins.items()}
    middle = [r for r in sweep[:-1] if all(r in b for b in beats.values())] if len(beats) == 2 else []
    with_interval = [d for d in differences if d.interval_s is not None]
    noise = dict(unresolved=sum(not d.resolved for d in with_interval), n=len(with_interval),
                 width=statistics.median(d.interval_s[1] - d.interval_s[0] for d in with_interval if d.interval_s),
                 size=statistics.median(abs(d.median_s) for d in with_interval), rounds=with_interval[0].rounds,
                 per_comparison=one_side_chance(with_interval[0].rounds),
                 by_chance=by_chance(with_interval, sides=1)) if with_interval else None
    return dict(adjacent=len(adjacent), told_apart=[d for d in adjacent if d.resolved], beats=beats, noise=noise,
                twins={ref: pairs for ref, pairs in twins.items() if pairs},
                word=None if unfit else "yes" if middle else "no",
                middle=middle, unfit=unfit)
