"""The in-job doctor's findings: what each rank saw of its own training in, sentences out.

Pure functions over :class:`RankObservation` (one per rank, gathered); each problem is one
sentence naming the values seen, ending with one line of advice. The parameter and straggler
checks are findings.py's, shared with ``make doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from cs336_systems.doctor.exchange import Progress
from cs336_systems.doctor.findings import (AFTER_FIRST_STEP, AFTER_TRAINING, ParameterChecksum,
                                           find_parameter_mismatches, find_stragglers, ranks_text, slow_outliers)

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
    rows: list[int] = field(default_factory=list)  # rows of each batch, in order
    data_wait_s: list[float] = field(default_factory=list)  # from an optimizer step to the next batch's start
    first_batch: int | None = None  # a checksum of the first batch's values
    optimizer_steps: int = 0
    step_s: list[float] = field(default_factory=list)  # time between consecutive optimizer steps
    compute_s: list[float] = field(default_factory=list)  # batch start to backward's own end
    names: list[str] = field(default_factory=list)  # the parameters compared across ranks
    shard_keys: list[tuple] = field(default_factory=list)  # per parameter: which ranks hold its values (in_job.shard_key)
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
    rows = [r.rows for r in ranks]
    uneven = next((i for i in range(min(map(len, rows), default=0)) if len({rs[i] for rs in rows}) > 1), None)
    if uneven is not None:
        problems.append(
            f"ranks trained on different numbers of samples per step (batch {uneven}: "
            f"{_by_rank([rs[uneven] for rs in rows])}): DDP averages the gradients over ranks, not samples, so a "
            "sample of the rank with fewer weighs more than one of the rank with more, and the step is not the one "
            "training on the global batch would take. Give every rank the same batch size (the same batch_size=, "
            "equal shards: DistributedSampler, drop_last=True for an uneven last batch)"
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
            found = find_parameter_mismatches([r.checksums[stage] for r in ranks], ranks[0].names, stage,
                                              _replica_peers(ranks))
            if found:
                return found
    return []


def _replica_peers(ranks: Sequence[RankObservation]) -> list[list[int]] | None:
    """Per rank and parameter, the lowest rank holding the same values (its shard key's); None when
    the ranks list different parameters (find_parameter_mismatches says so)."""
    keys = [r.shard_keys for r in ranks]
    if len({len(k) for k in keys}) > 1 or len(keys[0]) != len(ranks[0].names):
        return None
    return [[next(s for s in range(len(ranks)) if keys[s][i] == key) for i, key in enumerate(mine)]
            for mine in keys]


def find_slow_loaders(ranks: Sequence[RankObservation], factor: float, min_excess_s: float) -> list[str]:
    """Ranks that wait for their next batch far longer than the others, at their fastest."""
    fastest = [min(r.data_wait_s) if r.data_wait_s else None for r in ranks]
    if len(ranks) < 2 or None in fastest:
        return []
    return [
        f"rank {rank} waits for its data: at least {mine * 1e3:.1f} ms from an optimizer step to its next batch, "
        f"against {typical * 1e3:.1f} ms on the other ranks (median), and every other rank waits for it in the "
        "next gradient all-reduce. Load that rank's batches faster: DataLoader(num_workers=..., "
        "pin_memory=True, persistent_workers=True), lighter per-sample work, or data on a faster disk"
        for rank, mine, typical in slow_outliers(fastest, factor, min_excess_s)
    ]


def find_missing_at_report(arrived: Sequence[RankObservation], last: dict[int, Progress | None],
                           timeout_s: float) -> list[str]:
    """The ranks that did not reach report() within ``timeout_s``, what they last did, and the
    arrived ranks that ran fewer iterations than a missing one started (they skipped one)."""
    missing = sorted(last)
    said = "; ".join(f"rank {r}: " + (f"{p.doing} ({p.optimizer_steps} optimizer steps)" if p else "no batch yet")
                     for r, p in last.items())
    here = ", ".join(f"rank {r.rank} after {r.batches} batches and {r.optimizer_steps} optimizer steps"
                     for r in arrived)
    started = max((p.batches for p in last.values() if p is not None), default=0)
    behind = [r.rank for r in arrived if r.batches < started]
    if behind:
        why = (f"{ranks_text(behind).capitalize()} ran fewer iterations than {ranks_text(missing)} started: a rank that skips "
               "an iteration (a rank-local continue or break, a shorter loader) leaves the others waiting in that "
               "iteration's collectives. Skip iterations on every rank alike (all-reduce the condition first), or "
               "give every rank the same number of batches")
    else:
        why = (f"{ranks_text(missing).capitalize()} is slower or stuck outside the loop the others finished: read its log, "
               "or raise report_timeout_s if its steps are that long")
    return [f"{ranks_text(missing)} did not reach report() within {timeout_s:g} s (last seen: {said}); arrived: "
            f"{here}. {why}"]


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
            + find_slow_ranks(ranks, straggler_factor, straggler_min_excess_s)
            + find_slow_loaders(ranks, straggler_factor, straggler_min_excess_s))
