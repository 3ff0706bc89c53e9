"""The doctor's findings: gathered measurements in, plain-language sentences out.

Pure functions, no processes: each ``find_*`` takes what the ranks reported and returns one
sentence per problem, naming the values seen and what usually causes them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, NamedTuple, Sequence

SHOWN = 5  # indices, ranks or parameters quoted in a finding before "..."

# Stages at which parameters are compared, and what a mismatch first seen there usually means.
BEFORE_BROADCAST = "before any broadcast"
AFTER_WRAPPING = "right after wrapping in DDP"
AFTER_FIRST_STEP = "after the first optimizer step"
AFTER_TRAINING = "after the training steps"
_DIFFERENT_STEPS = ("replicas took different optimizer steps: gradients were not averaged over all ranks "
                    "(a model not wrapped in DDP, or trained through .module instead of the wrapper), a rank "
                    "changed its weights alone, or ranks used different learning rates or optimizers")
STAGE_CAUSES = {
    BEFORE_BROADCAST: "ranks were seeded differently and nothing broadcast rank 0's weights; "
    "wrap the model in DDP (which broadcasts) or seed every rank alike",
    AFTER_WRAPPING: "the DDP wrapper did not broadcast rank 0's parameters and buffers at "
    "construction",
    AFTER_FIRST_STEP: _DIFFERENT_STEPS,
    AFTER_TRAINING: _DIFFERENT_STEPS,
}


class ParameterChecksum(NamedTuple):
    """What one rank knows about one parameter, small enough to gather for every parameter."""

    bit_sum: int  # sum of the raw bit patterns as integers: exact and independent of order
    value_sum: float  # float64 sums, for reading; their rounding may depend on reduction order
    square_sum: float


def _shown(values: Sequence[Any]) -> str:
    head = ", ".join(str(v) for v in values[:SHOWN])
    return f"[{head}{', ...' if len(values) > SHOWN else ''}]"


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def find_missing_ranks(checkin_s: Sequence[float | None], timeout_s: float) -> list[str]:
    """Ranks that checked in later than ``timeout_s`` after rank 0 started (None: never)."""
    late = [r for r, t in enumerate(checkin_s) if t is None or t > timeout_s]
    if not late:
        return []
    seen = [f"rank {r} after {checkin_s[r]:.1f} s" for r in late if checkin_s[r] is not None]
    arrival = f" (arrived late: {', '.join(seen)})" if seen else ""
    return [
        f"{ranks_text(late)} did not check in within {timeout_s:g} s of rank 0{arrival}: every other "
        "rank waits for it in the next collective. A rank stuck before the first step (slow "
        "data loading, a collective the others skipped, a different code path) looks like this; "
        f"read {ranks_text(late)}'s log for what it was doing"
    ]


def find_shard_problems(
    indices_per_rank: Sequence[Sequence[int]], dataset_len: int, drop_last: bool = False
) -> list[str]:
    """Whether the ranks' sampler indices split ``range(dataset_len)`` into disjoint shards.

    ``DistributedSampler`` makes every shard ``ceil(len / n)`` long by repeating a few indices
    (``drop_last=False``: up to ``(-len) mod n`` repeats) or ``floor(len / n)`` by leaving a few
    out (``drop_last=True``: up to ``len mod n``); those are not problems.
    """
    n = len(indices_per_rank)
    lengths = [len(indices) for indices in indices_per_rank]
    problems = []
    if len(set(lengths)) > 1:
        counts = ", ".join(f"rank {r}: {k}" for r, k in enumerate(lengths))
        problems.append(
            f"DistributedSampler gives ranks different numbers of samples ({counts}): ranks run "
            "different numbers of steps, and the ones with more hang in a collective the others "
            "never join; did every rank pass the same num_replicas=?"
        )
    counts = Counter(i for indices in indices_per_rank for i in indices)
    outside = sorted(i for i in counts if not 0 <= i < dataset_len)
    if outside:
        problems.append(
            f"DistributedSampler gave indices outside the dataset of {dataset_len}: {_shown(outside)}"
        )
    repeats = sum(c - 1 for c in counts.values())
    missing = [i for i in range(dataset_len) if i not in counts]
    allowed_repeats = 0 if drop_last else (-dataset_len) % n
    allowed_missing = dataset_len % n if drop_last else 0
    parts = []
    if repeats > allowed_repeats:
        a, b, shared = _first_overlap(indices_per_rank)
        if shared:
            parts.append(
                f"ranks {a} and {b} both get indices {_shown(shared)} ({len(shared)} shared)"
            )
        else:
            parts.append(f"{repeats} indices repeat within one rank's shard")
    if len(missing) > allowed_missing:
        parts.append(f"{len(missing)} of {dataset_len} indices reach no rank ({_shown(missing)})")
    if parts:
        problems.append(
            f"DistributedSampler shards {'overlap' if repeats > allowed_repeats else 'miss data'}: "
            f"{'; '.join(parts)}: did every rank construct the sampler with its own rank= and "
            "the same num_replicas=?"
        )
    return problems


def _first_overlap(indices_per_rank: Sequence[Sequence[int]]) -> tuple[int, int, list[int]]:
    sets = [set(indices) for indices in indices_per_rank]
    for a in range(len(sets)):
        for b in range(a + 1, len(sets)):
            shared = sorted(sets[a] & sets[b])
            if shared:
                return a, b, shared
    return 0, 0, []


def find_parameter_mismatches(
    checksums_per_rank: Sequence[Sequence[ParameterChecksum]], names: Sequence[str], stage: str,
    peers: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """Ranks whose parameters differ from rank 0's at ``stage`` (a key of STAGE_CAUSES).

    Parameters are compared by ``bit_sum``: equal bits give equal sums whatever the summation
    order, and a changed value almost always changes its bits' integer sum. ``peers[r][i]``, if
    given, is the rank whose parameter ``i`` rank ``r``'s must equal instead of rank 0's (``r``
    itself: nothing to compare, as for a shard no other rank holds).
    """
    if stage not in STAGE_CAUSES:
        raise ValueError(f"stage must be one of {list(STAGE_CAUSES)}, got {stage!r}")
    reference = checksums_per_rank[0]
    if len(reference) != len(names):
        raise ValueError(f"{len(names)} names for rank 0's {len(reference)} parameter checksums")
    counts = [len(c) for c in checksums_per_rank]
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {k}" for r, k in enumerate(counts))
        return [f"ranks hold different numbers of parameters {stage} ({listed}): ranks built different models"]
    differing = []
    for rank, checksums in enumerate(checksums_per_rank):
        peer_of = peers[rank] if peers is not None else [0] * len(names)
        bad = [i for i, mine in enumerate(checksums)
               if peer_of[i] != rank and mine.bit_sum != checksums_per_rank[peer_of[i]][i].bit_sum]
        if bad:
            first = bad[0]
            peer = peer_of[first]
            differing.append(
                f"rank {rank}'s parameters differ from rank {peer}'s in {len(bad)} of {len(names)} "
                f"(first: {names[first]}, value sum {checksums[first].value_sum:.6g} vs "
                f"{checksums_per_rank[peer][first].value_sum:.6g})"
            )
    if not differing:
        return []
    return [f"{'; '.join(differing)} {stage}: {STAGE_CAUSES[stage]}"]


def find_stragglers(
    compute_s_per_rank: Sequence[float],
    factor: float,
    min_excess_s: float = 0.0,
    load_per_core: Sequence[float | None] | None = None,
) -> list[str]:
    """Ranks more than ``factor`` times (and ``min_excess_s``) slower than the others' median.

    Give each rank's *fastest* step: interference from other processes only ever adds time, so
    a rank whose fastest step is slow is slow every step, while noise on a shared machine
    makes one rank's median step twice another's now and then. (A rank slow only some steps,
    say while it logs, is missed; the table's median column shows it.) ``load_per_core``, the
    load average of each rank's host per core, adds a warning for oversubscribed hosts.
    """
    problems = []
    for rank, mine, typical in slow_outliers(compute_s_per_rank, factor, min_excess_s):
        ratio = f"{mine / typical:.1f}x" if typical > 0 else "far more than"
        load = load_per_core[rank] if load_per_core is not None else None
        busy = (
            f". Its host is oversubscribed (load average {load:.1f} per core), which alone "
            "can do this: rerun when the host is quiet"
            if load is not None and load > 1
            else ""
        )
        problems.append(
            f"rank {rank} is a straggler: its fastest step computes in {mine * 1e3:.1f} ms, {ratio} the "
            f"median of the other ranks ({typical * 1e3:.1f} ms), and every other rank waits "
            "for it in each gradient all-reduce. Look for a slower or shared device, CPU "
            "contention (threads per rank), or extra work on that rank (logging, data loading)"
            + busy
        )
    return problems


def slow_outliers(seconds_per_rank: Sequence[float], factor: float,
                  min_excess_s: float = 0.0) -> list[tuple[int, float, float]]:
    """``(rank, its time, the other ranks' median)`` for each rank more than ``factor`` times
    (and ``min_excess_s``) slower than the median of the others."""
    found = []
    for rank, mine in enumerate(seconds_per_rank):
        others = [t for r, t in enumerate(seconds_per_rank) if r != rank]
        if others:
            typical = statistics.median(others)
            if mine > factor * typical and mine - typical > min_excess_s:
                found.append((rank, mine, typical))
    return found
