"""One (configuration, rank) of the sharded-optimizer accounting, as stored in ``sharded_optimizer.json``.

Memory is read at four points of a rank's run of one configuration, each the peak since the
previous point and the level at it, above ``baseline_bytes`` (the level before the model was
built): ``after_model`` (the model built), ``after_init`` (wrapped in DDP, optimizer built),
``before_step`` (forward, backward and gradient all-reduce done) and ``after_step`` (after
``optimizer.step()``). Times are the slowest rank's per round, in round order: entry ``i`` of
both configurations was timed in the same round, which is what the paired difference relies on.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar, Sequence

from cs336_systems.bench.stats import paired_median
from cs336_systems.results.schema import Record

UNSHARDED, SHARDED = "unsharded", "sharded"
CONFIGURATIONS = (UNSHARDED, SHARDED)  # plain AdamW on every rank; ShardedOptimizer over AdamW
PHASES = ("after_model", "after_init", "before_step", "after_step")


@dataclass(frozen=True)
class PhaseMemory:
    """Memory at one point, and what its peak holds (tensor bytes counted storage by storage)."""

    peak_above_baseline_bytes: int  # the meter's peak since the previous point, above the baseline
    current_above_baseline_bytes: int | None  # the level now (None where the meter cannot read it)
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int  # this rank's (its shard, when sharded)
    other_bytes: int  # the peak less the three above: activations, temporaries, communication
    # buffers, allocator slack

    @property
    def counted_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes


@dataclass(frozen=True)
class AccountingRecord(Record):
    """One configuration on one rank: memory at each point, optimizer state, bytes moved, times."""

    KIND: ClassVar[str] = "sharded_optimizer"
    VERSION: ClassVar[int] = 1

    configuration: str  # "unsharded" (AdamW on every rank) or "sharded" (ShardedOptimizer over AdamW)
    rank: int
    world_size: int
    method: str  # how memory was read: "rss" or "cuda_allocator" (see meters.py)
    peak_resettable: bool  # whether the meter's peak could be reset at each point
    malloc_mmap_threshold_bytes: int | None  # glibc's fixed mmap threshold (None: not set)
    baseline_bytes: int  # the meter's level before this configuration's model was built
    baseline_live_tensor_bytes: int  # tensors Python could reach then: 0 unless something leaked
    after_model: PhaseMemory
    after_init: PhaseMemory
    before_step: PhaseMemory
    after_step: PhaseMemory
    n_parameters: int
    n_parameter_tensors: int
    parameter_bytes: int  # B
    largest_parameter_bytes: int
    owned_parameters: int  # parameter tensors whose optimizer state this rank keeps
    owned_parameter_bytes: int
    optimizer_state_bytes: int  # measured after the step
    expected_optimizer_state_bytes: float  # 2B, or 2B/n when sharded
    # A shard exceeds B/n by at most the largest parameter (assign_to_ranks), its moments 2x.
    optimizer_state_imbalance_bound_bytes: int
    broadcast_received_bytes: int  # what this rank receives per step: every parameter it does not own
    step_times_s: list[float]  # slowest rank per round: forward, backward, all-reduce, optimizer step
    optimizer_step_times_s: list[float]  # slowest rank per round: optimizer.step() alone

    @property
    def sharded(self) -> bool:
        return self.configuration == SHARDED

    def phase(self, name: str) -> PhaseMemory:
        """The memory at point ``name`` (one of :data:`PHASES`)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        return getattr(self, name)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def median_optimizer_step_s(self) -> float:
        return statistics.median(self.optimizer_step_times_s)


def sharded_minus_unsharded(
    records: Sequence[AccountingRecord], times: str = "step_times_s"
) -> tuple[float, tuple[float, float] | None] | None:
    """The median over rounds of (sharded - unsharded) ``times`` ("step_times_s" or
    "optimizer_step_times_s") and its 95% sign-test interval (None: fewer than 6 rounds);
    None when the records lack either configuration."""
    first = {}
    for r in records:
        first.setdefault(r.configuration, r)  # every rank holds the same slowest-rank times
    if SHARDED not in first or UNSHARDED not in first:
        return None
    return paired_median(getattr(first[SHARDED], times), getattr(first[UNSHARDED], times))
