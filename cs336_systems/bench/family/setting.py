"""What one run of the family benchmark measures: which models, how many rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.bench.family.models import FAMILY
from cs336_systems.bench.workload import shard_rows
from cs336_systems.launch.setting import LaunchSetting


@dataclass(frozen=True)
class FamilySetting(LaunchSetting):
    """Ranks and device (LaunchSetting), the models, and how their variants are timed."""

    models: tuple[str, ...] = field(default=tuple(FAMILY), metadata=cli.choice(
        "models of the family to time, one after another in one process group", FAMILY, many=True))
    rounds: int = field(default=16, metadata=cli.count(
        "interleaved rounds per model: each times every variant once, the order rotated by one per round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each variant before it is first timed (auto: after its tuning steps)", minimum=0))
    seed: int = field(default=0, metadata=cli.count("seed of the weights and the data", minimum=0))

    def validate(self) -> None:
        """ValueError for a setting that cannot run, before any process starts."""
        super().validate()
        if not self.models or len(set(self.models)) != len(self.models):
            raise ValueError(f"--models must name each model at most once, got {' '.join(self.models)}")
        unknown = [m for m in self.models if m not in FAMILY]
        if unknown:
            raise ValueError(f"unknown models {', '.join(unknown)}; known: {', '.join(FAMILY)}")
        for name in self.models:
            try:
                shard_rows(FAMILY[name].global_batch, 0, self.ranks)
            except ValueError as e:
                raise ValueError(f"model {name}: {e}") from e
