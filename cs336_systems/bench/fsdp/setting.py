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

    def validate(self) -> None:
        """ValueError for a setting that cannot run, before any process starts."""
        super().validate()
        for name, value, low in (("rounds", self.rounds, 1), ("steps_per_round", self.steps_per_round, 1),
                                 ("warmup_steps", self.warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
