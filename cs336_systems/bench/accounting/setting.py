"""What one run of the sharded-optimizer accounting measures (the flags of bench_sharded_optimizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.bench.workload import WorkloadSetting
from cs336_systems.zero.optimizer import bucket_cap_bytes


@dataclass(frozen=True)
class AccountingSetting(WorkloadSetting):
    """The workload (ranks, device, model, global batch) and how both configurations are run."""

    steps: int = field(default=8, metadata=cli.count(
        "timed rounds; each times one step of each configuration, the order alternating (at least 6 "
        "give the paired difference a 95%% interval)"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each configuration first (the first step allocates AdamW's state)", minimum=0))
    bucket_size_mb: float = field(default=32.0, metadata=cli.positive(
        "ShardedOptimizer's broadcast bucket cap in MB", high=cli.MAX_MB))
    lr: float = 1e-4  # AdamW's learning rate (other hyperparameters at torch's defaults)

    def validate(self) -> None:
        """ValueError for a setting that cannot run, before any process starts."""
        super().validate()
        bucket_cap_bytes(self.bucket_size_mb)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
