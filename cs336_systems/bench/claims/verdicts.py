"""A verdict per claim from one run's records: holds, does not hold here, or not resolved.

Speed: per round, the baseline's step time over the tuned configuration's (both the median of
that round's timed steps), so > 1 means the tuned one is faster; its median over rounds comes
with the sign-test 95% interval (bench/stats.py). A claim of "x-y% faster" *holds* when the
interval's low end reaches x, *does not hold here* when its high end stays below x, and is
*not resolved* otherwise (the interval straddles x, or too few rounds for one). "No slower"
(ours against torch's DDP) is the same rule with x = 1.0: it holds only when the interval
lies at or above 1.

Memory: the saving ``1 - tuned / baseline`` of the largest rank's peak, median over rounds, is
evidence only where every fit had processes of its own (``fit_per_process`` in the run's notes):
``torch.cuda.reset_peak_memory_stats`` resets the high-water mark to what is allocated *now*,
so fits sharing a process report peaks that include what earlier fits left allocated (on one
H200 run, torch's DDP's peak rose 3108 -> 5127 -> 5624 -> 7131 -> 7638 MiB over five rounds).
Such runs get NOT_EVIDENCE. Without allocator statistics (CPU) the memory claim is not resolved.
A run taken while other jobs loaded the machine (results.environment.Load) is not evidence for
either. BatchNorm: the claim holds when ``sync_batchnorm`` brings every rank's running
statistics to one process's within float32 rounding (1e-4) while the unsynchronised ones are
off by more than 10x that.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from cs336_systems.bench.claims.configs import CLAIMS, Claim
from cs336_systems.bench.claims.record import ClaimsRecord
from cs336_systems.bench.stats import median_interval

HOLDS, FAILS, UNRESOLVED = "holds", "does not hold here", "not resolved"
NOT_EVIDENCE = "not evidence"
BATCHNORM_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    speedup: float  # median over rounds of baseline / tuned step time
    speedup_ci95: tuple[float, float] | None
    memory_saving: float | None  # median of 1 - tuned / baseline peak; None without statistics
    verdict: str  # on speed
    memory_verdict: str | None  # None where the claim says nothing of memory

    @property
    def speedup_text(self) -> str:
        ci = f" [{self.speedup_ci95[0]:.3f}, {self.speedup_ci95[1]:.3f}]" if self.speedup_ci95 else " (too few rounds)"
        return f"{self.speedup:.3f}x{ci}"

    @property
    def memory_text(self) -> str:
        if self.claim.claimed_memory_saving is None:
            return "-"
        return "not measured (CPU)" if self.memory_saving is None else f"{self.memory_saving:+.1%}"


def speed_verdict(claim: Claim, median: float, ci: tuple[float, float] | None) -> str:
    assert claim.claimed_speedup is not None
    low = claim.claimed_speedup[0]
    if ci is None:
        return UNRESOLVED
    if ci[0] >= low:
        return HOLDS
    return FAILS if ci[1] < low else UNRESOLVED


def judge(claim: Claim, by_name: dict[str, ClaimsRecord], memory_evidence: bool = False,
          speed_evidence: bool = True) -> Verdict:
    """``memory_evidence``: every fit had processes of its own (peaks not contaminated);
    ``speed_evidence``: the machine was quiet (its load within the run's cores)."""
    base, tuned = by_name[claim.baseline], by_name[claim.tuned]
    ratios = [b / t for b, t in zip(base.round_times_s(), tuned.round_times_s())]
    median, ci = statistics.median(ratios), median_interval(ratios)
    saving, memory_verdict = None, None
    if claim.claimed_memory_saving is not None:
        memory_verdict = UNRESOLVED
        if base.peak_memory_bytes and tuned.peak_memory_bytes:
            saving = statistics.median(1 - t / b for b, t in zip(base.peak_memory_bytes, tuned.peak_memory_bytes))
            memory_verdict = (NOT_EVIDENCE if not memory_evidence
                              else HOLDS if saving >= claim.claimed_memory_saving[0] else FAILS)
    speed = speed_verdict(claim, median, ci) if speed_evidence else NOT_EVIDENCE
    return Verdict(claim, median, ci, saving, speed, memory_verdict)


def judge_all(records: Sequence[ClaimsRecord], memory_evidence: bool = False,
              speed_evidence: bool = True) -> list[Verdict]:
    by_name = {r.config: r for r in records}
    return [judge(c, by_name, memory_evidence, speed_evidence)
            for c in CLAIMS if c.baseline in by_name and c.tuned in by_name]


def batchnorm_verdict(figures: dict[str, Any] | None) -> str:
    """sync_batchnorm's claim from batchnorm_deviation's figures (run.py)."""
    if not figures or "error" in figures:
        return UNRESOLVED
    synced = max(figures["running_mean_synced"], figures["running_var_synced"])
    local = max(figures["running_mean_local"], figures["running_var_local"])
    return HOLDS if synced <= BATCHNORM_TOLERANCE and local > 10 * BATCHNORM_TOLERANCE else FAILS
