"""Peak device memory of each FSDP-benchmark configuration, every one in processes of its own.

The step benchmark (run.py) keeps all four configurations alive in one process group, which
the handout's xl model cannot afford on one GPU (each holds its own model copy and optimizer),
and a process that has trained one configuration carries its leftovers into the next one's
peak. Here each configuration gets fresh ranks: they build the workload (its weights drawn on
the device: xl's two billion take tens of seconds on a CPU, once per configuration), then the
configuration (configurations.py) on a copy of its model, run ``warmup_steps`` steps (AdamW
makes its state at its first) and one more step, and report the CUDA allocator's figures
above the level before the configuration was built (the workload's own model and batch):
what the configuration itself holds at its peak, which Section 6's accounting predicts
(16Ψ bytes under DDP, (8 + 8/n)Ψ under the sharded optimizer, 16Ψ/n under FSDP, FP32 AdamW,
plus activations and gathered weights). Ranks sharing one GPU each have their own allocator,
so the figures are per rank whatever the backend. A CPU has no allocator statistics: there a
run only checks the path (the figures are -1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from cs336_systems import cli
from cs336_systems.bench.fsdp.configurations import CONFIGURATIONS, DESCRIPTIONS, build_configuration
from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.workload import WorkloadSetting, build_workload
from cs336_systems.comm.timing import sync_device
from cs336_systems.launch import RankContext, run_ranks
from cs336_systems.results.schema import Record

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class FsdpMemorySetting(WorkloadSetting):
    """The workload, and which configurations to build (each in ranks of its own)."""

    configurations: tuple[str, ...] = field(default=CONFIGURATIONS, metadata=cli.choice(
        "configurations to measure, one after another, each in fresh processes", CONFIGURATIONS, many=True))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "steps before the measured one (AdamW makes its state at its first)", minimum=1))

    def validate(self) -> None:
        super().validate()
        if not self.configurations or len(set(self.configurations)) != len(self.configurations):
            raise ValueError(f"--configurations must name each at most once, got {' '.join(self.configurations)}")


@dataclass(frozen=True)
class FsdpMemoryRecord(Record):
    """One configuration's memory on every rank, in bytes above the level before it was built."""

    KIND: ClassVar[str] = "fsdp_memory"
    VERSION: ClassVar[int] = 1

    configuration: str  # configurations.CONFIGURATIONS' name
    description: str
    n_parameters: int  # Ψ
    built_bytes: list[int]  # per rank: held once built, before any step (-1 without allocator statistics)
    peak_bytes: list[int]  # per rank: the allocator's high-water mark over the last step
    held_after_step_bytes: list[int]  # per rank: held after the last step (parameters, state, gradients)


@dataclass(frozen=True)
class FsdpMemoryRun(BenchmarkRun):
    n_parameters: int = 0

    @property
    def notes(self) -> dict:
        return {"n_parameters": self.n_parameters, "fit_per_process": True}


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else -1


def _memory_rank(ctx: RankContext, setting: FsdpMemorySetting, name: str) -> tuple[int, int, int, int]:
    """(Ψ, built, peak, held after the step) on this rank, bytes above the level before building."""
    work = build_workload(ctx, setting, init_on_device=True)
    sync_device(ctx.device)
    base = _allocated(ctx.device)
    config = build_configuration(name, work.module)
    sync_device(ctx.device)
    built = _allocated(ctx.device) - base
    for _ in range(setting.warmup_steps):
        config.step(work)
    sync_device(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    config.step(work)
    sync_device(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - base if ctx.device.type == "cuda" else -1
    held = _allocated(ctx.device) - base
    if ctx.device.type != "cuda":
        built = held = -1
    return sum(p.numel() for p in work.module.parameters()), built, peak, held


def run_fsdp_memory(setting: FsdpMemorySetting) -> FsdpMemoryRun:
    """Each configuration in ranks spawned here for it alone; records in the order asked."""
    setting.validate()
    records, n_parameters = [], 0
    for name in setting.configurations:
        per_rank = run_ranks(_memory_rank, setting.world_size, args=(setting, name), backend=setting.backend,
                             device_type=setting.device, timeout_s=RANK_TIMEOUT_S, join_timeout_s=RUN_TIMEOUT_S)
        n_parameters = per_rank[0][0]
        records.append(FsdpMemoryRecord(name, DESCRIPTIONS[name], n_parameters, *([r[i] for r in per_rank]
                                                                                  for i in (1, 2, 3))))
    shared = setting.device == "cuda" and setting.world_size > 1 and setting.backend_name == "gloo"
    return FsdpMemoryRun(records=records, world_size=setting.world_size, shared_gpu=shared, rank=0,
                         n_parameters=n_parameters)
