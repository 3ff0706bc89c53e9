"""What one run of the FSDP step benchmark measures: the workload and its interleaved rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.bench.workload import WorkloadSetting


@dataclass(frozen=True)
class FsdpSetting(WorkloadSetting):
    """The workload (ranks, device, model, batch) and how its four configurations are timed."""

    rounds: int = field(default=6, metadata=cli.count(
        "interleaved rounds: each times every configuration, the order rotated by one each round"))
    steps_per_round: int = field(default=1, metadata=cli.count("timed steps of each configuration per round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each configuration before it is first timed", minimum=0))
