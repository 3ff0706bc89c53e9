"""The in-job doctor's findings: what each rank saw of its own training in, sentences out.

Pure functions over :class:`RankObservation` (one per rank, gathered); each problem is one
sentence naming the values seen, ending with one line of advice. The parameter and straggler
checks are findings.py's, shared with ``make doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from cs336_systems.doctor.findings import (AFTER_FIRST_STEP, AFTER_TRAINING, ParameterChecksum,
                                           find_parameter_mismatches, find_stragglers, ranks_text)

DISTRIBUTED_SAMPLER = "DistributedSampler"


@dataclass
class RankObservation:
    """What one rank saw of its own training: small, plain values, gathered to every rank."""

    rank: int
    world_size: int
    backend: str
    hostname: str
    device: str
    sampler: str | None = None  # the DataLoader's sampler class (None: no loader given)
    sampler_replicas: int | None = None  # a DistributedSampler's num_replicas and rank
    sampler_rank: int | None = None
    batches_per_epoch: int | None = None  # len(loader)
    batches: int = 0  # training batches seen
    samples: int = 0  # rows of those batches
    first_batch: int | None = None  # a checksum of the first batch's values
    optimizer_steps: int = 0
    step_s: list[float] = field(default_factory=list)  # time between consecutive optimizer steps
    compute_s: list[float] = field(default_factory=list)  # batch start to backward's own end
    names: list[str] = field(default_factory=list)  # the parameters compared across ranks
    checksums: dict[str, list[ParameterChecksum]] = field(default_factory=dict)  # by stage


def _by_rank(values: Sequence[object]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def find_sampler_problems(ranks: Sequence[RankObservation]) -> list[str]:
    """Ranks whose loader is not a DistributedSampler of this group, and shards that coincide."""
    n = len(ranks)
    problems = []
    plain = [r.rank for r in ranks if r.sampler is not None and r.sampler != DISTRIBUTED_SAMPLER]
    if plain:
        kinds = sorted({ranks[r].sampler or "" for r in plain})
        problems.append(
            f"{ranks_text(plain)} draw{'s' if len(plain) == 1 else ''} batches with {', '.join(kinds)}, not a "
            f"DistributedSampler: such a rank reads the whole dataset instead of its 1/{n} shard, so ranks "
            "train on the same samples and its epoch is longer. Pass sampler=DistributedSampler(dataset) to its "
            "DataLoader (Lightning adds one unless use_distributed_sampler=False)"
        )
    wrong = [r for r in ranks if r.sampler == DISTRIBUTED_SAMPLER
             and (r.sampler_replicas != n or r.sampler_rank != r.rank)]
    for r in wrong:
        problems.append(
            f"rank {r.rank}'s DistributedSampler has num_replicas={r.sampler_replicas}, rank={r.sampler_rank} "
            f"in a group of {n} where it is rank {r.rank}: its shard overlaps another's or leaves data out. "
            "Build it without num_replicas= and rank= (it reads them from the process group)"
        )
    firsts = [r.first_batch for r in ranks]
    if n > 1 and None not in firsts and len(set(firsts)) == 1:
        problems.append(
            f"every rank's first batch holds the same values ({n} ranks): the shards coincide, so the "
            f"job trains on 1/{n} of the data it could. Give each rank its own shard (a DistributedSampler "
            "per rank, or data split by rank)"
        )
    return problems


def find_progress_problems(ranks: Sequence[RankObservation]) -> list[str]:
    """Ranks that saw different numbers of batches per epoch, batches or optimizer steps."""
    problems = []
    per_epoch = [r.batches_per_epoch for r in ranks]
    if None not in per_epoch and len(set(per_epoch)) > 1:
        problems.append(
            f"ranks have different numbers of batches per epoch ({_by_rank(per_epoch)}): at the end of an "
            "epoch the ranks with more wait in a collective the others never join. Shard with "
            "DistributedSampler on every rank (equal shards), or drop_last=True"
        )
    batches = [r.batches for r in ranks]
    if len(set(batches)) > 1:
        problems.append(
            f"ranks trained on different numbers of batches ({_by_rank(batches)}): a rank that skips a batch "
            "pairs its collectives with another step's. Skip batches on every rank alike, or on none"
        )
    steps = [r.optimizer_steps for r in ranks]
    if len(set(steps)) > 1 and len(set(batches)) == 1:
        problems.append(
            f"ranks stepped their optimizers different numbers of times in {batches[0]} batches "
            f"({_by_rank(steps)}): a rank-local condition (a NaN check, a loss threshold, a scaler) skipped "
            "optimizer.step() on some ranks, and their replicas now differ. Decide to skip on every rank alike "
            "(all-reduce the condition first)"
        )
    return problems


def find_parameter_divergence(ranks: Sequence[RankObservation]) -> list[str]:
    """Replicas whose parameters differ after the first step or at the end (the first stage only)."""
    if not ranks[0].names:
        return []
    for stage in (AFTER_FIRST_STEP, AFTER_TRAINING):
        if all(stage in r.checksums for r in ranks):
            found = find_parameter_mismatches([r.checksums[stage] for r in ranks], ranks[0].names, stage)
            if found:
                return found
    return []


def find_slow_ranks(ranks: Sequence[RankObservation], factor: float, min_excess_s: float) -> list[str]:
    """Stragglers by each rank's fastest compute after the first (warm-up) batch."""
    fastest = [min(r.compute_s[1:]) if len(r.compute_s) > 1 else None for r in ranks]
    if len(ranks) < 2 or None in fastest:
        return []
    return find_stragglers(fastest, factor, min_excess_s)


def job_findings(ranks: Sequence[RankObservation], straggler_factor: float = 1.5,
                 straggler_min_excess_s: float = 0.02) -> list[str]:
    """Every finding over the gathered observations, in the order a person would fix them."""
    return (find_sampler_problems(ranks) + find_progress_problems(ranks) + find_parameter_divergence(ranks)
            + find_slow_ranks(ranks, straggler_factor, straggler_min_excess_s))
