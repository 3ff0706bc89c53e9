"""What one diagnostic run does (the flags of scripts/doctor.py), and the faults it can plant."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from cs336_systems import cli
from cs336_systems.bench.workload import WorkloadSetting
from cs336_systems.ddp.auto_bucket import DEFAULT_BUCKET_MB, check_calibration
from cs336_systems.units import KB, MB

UNSEEDED = "unseeded-no-broadcast"  # each rank seeds differently; the raw model trains unwrapped
OVERLAPPING_SHARDS = "overlapping-shards"  # every rank builds its sampler as if it were rank 0
STRAGGLER = "straggler"  # rank 1 sleeps in every step
MISSING_RANK = "missing-rank"  # rank 1 checks in only after rank 0 has given up on it
INJECTIONS = (UNSEEDED, OVERLAPPING_SHARDS, STRAGGLER, MISSING_RANK)
FAULTY_RANK = 1  # the rank that misbehaves in STRAGGLER and MISSING_RANK
ON_FAULTY_RANK = (STRAGGLER, MISSING_RANK)

_WORKLOAD = {f.name: f for f in fields(WorkloadSetting)}


def _workload_flag(name: str, default: object) -> object:
    """The workload's flag ``name`` (its help and check), with the doctor's own default."""
    return field(default=default, metadata=_WORKLOAD[name].metadata)


@dataclass(frozen=True)
class DoctorSetting(WorkloadSetting):
    """A short run of the tiny model on every rank, and what counts as a problem."""

    model_size: str = _workload_flag("model_size", "tiny")  # the step's model and the bucket's s
    context_length: int = _workload_flag("context_length", 32)
    global_batch: int = _workload_flag("global_batch", 8)
    steps: int = field(default=5, metadata=cli.count("timed training steps whose compute is compared across ranks"))
    dataset_len: int = field(default=64, metadata=cli.count("samples in the synthetic dataset the sampler shards"))
    straggler_factor: float = field(default=1.5, metadata=cli.option(
        "flag a rank this many times slower than the others' median", cli.Number(1.0, 1000.0)))
    checkin_timeout_s: float = field(default=15.0, metadata=cli.positive(
        "how long rank 0 waits for the others to check in (below --timeout-s)", high=86400.0))
    timeout_s: float = field(default=120.0, metadata=cli.positive(
        "process-group timeout: bounds every collective", high=86400.0))
    inject: str | None = field(default=None, metadata=cli.choice("plant a known fault", INJECTIONS))
    warmup_steps: int = 1  # untimed steps (the first pays allocation and bucket set-up)
    bucket_size_mb: float = DEFAULT_BUCKET_MB  # BucketedDDP's cap in the step (MB = 2**20 bytes)
    straggler_min_excess_s: float = 0.02  # a straggler is also this much slower (timer noise)
    calibration_bytes: tuple[int, ...] = (4 * KB, 64 * KB, 512 * KB, 4 * MB)  # all-reduce payloads to time
    calibration_iters: int = 10  # timed all-reduces per payload (after one warm-up)
    straggler_delay_s: float = 0.3  # how long the injected straggler sleeps per step

    @property
    def batch_per_rank(self) -> int:
        return self.global_batch // self.ranks

    def validate(self) -> None:
        """ValueError for a setting that cannot work, before any rank starts."""
        super().validate()
        if self.inject is not None and self.inject not in INJECTIONS:
            raise ValueError(f"inject must be one of {INJECTIONS} or None, got {self.inject!r}")
        if self.inject in ON_FAULTY_RANK and self.ranks <= FAULTY_RANK:
            raise ValueError(
                f"--inject {self.inject} plants the fault on rank {FAULTY_RANK}, which needs world size > "
                f"{FAULTY_RANK}, got {self.ranks}"
            )
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise ValueError(f"straggler_factor must be > 1, got {self.straggler_factor}")
        if not 0 < self.checkin_timeout_s < self.timeout_s:
            raise ValueError(
                f"--checkin-timeout-s must be > 0 and below the process-group timeout --timeout-s "
                f"({self.timeout_s:g} s), got {self.checkin_timeout_s:g}"
            )
        check_calibration(self.calibration_bytes, self.calibration_iters)
