"""The FSDP step benchmark's rank function: build, warm up, interleave, count, trace.

One process group trains the LM with each configuration (configurations.py), each on its own
copy of the model with its own optimizer, built once and warmed up once. The timed steps run
interleaved round by round (round r: a few steps of each configuration in turn, the order
rotated by one configuration each round, so that no configuration always follows the same
one and a noisy machine's drift hits all alike). Each timed step starts after a barrier; its
time is the slowest rank's. Then, untimed, one step of each configuration under the counting
mode (accounting.py: memory and collective bytes) and one step of each FSDP under the tracer
(tracing.py: the timeline).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.allreduce.plan import available_memory_bytes, ranks_per_memory
from cs336_systems.bench.fsdp.accounting import StepAccounting
from cs336_systems.bench.fsdp.configurations import CONFIGURATIONS, Configuration, build_configuration
from cs336_systems.bench.fsdp.formulas import FSDP, TORCH_FSDP
from cs336_systems.bench.fsdp.record import MEMORY_PARTS
from cs336_systems.bench.fsdp.setting import FsdpSetting
from cs336_systems.bench.fsdp.summarize import Measured, summarize
from cs336_systems.bench.fsdp.tracing import StepTracer
from cs336_systems.bench.workload import Workload, build_workload
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.launch import RankContext, run_setting

RANK_TIMEOUT_S = 600  # one collective on a loaded machine with a large model
RUN_TIMEOUT_S = 3600  # the whole run
TRACED = (FSDP, TORCH_FSDP)  # whose step the writeup draws


@dataclass(frozen=True)
class FsdpRun(BenchmarkRun):
    """A finished run, as one process sees it."""

    n_parameters: int = 0

    @property
    def notes(self) -> dict:
        """Run-level figures for the results file."""
        return {"n_parameters": self.n_parameters}


def timed_step(config: Configuration, work: Workload, device: torch.device) -> float:
    """One step of ``config``, from a barrier to the device's last kernel (answers/run.py too)."""
    sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    config.step(work)
    sync_device(device)
    return time.perf_counter() - start


def _count_step(config: Configuration, work: Workload,
                device: torch.device) -> tuple[list[float], StepAccounting]:
    """One step under the counting mode: ([peak, its parts..., resident, allocator peak or -1],
    the accounting with the step's collectives)."""
    sync_device(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    accounting = StepAccounting(config)
    with accounting:
        config.step(work)
    sync_device(device)
    allocator = -1.0
    if device.type == "cuda":  # the step's rise above the start, on top of what this one holds
        allocator = torch.cuda.max_memory_allocated(device) - before + accounting.resident_bytes
    parts = [accounting.peak_parts[p] for p in MEMORY_PARTS]
    return [accounting.peak_bytes, *parts, accounting.resident_bytes, allocator], accounting


def _largest_rank_values(values: list[float], device: torch.device) -> list[float]:
    """``values`` of the rank whose first value (the peak) is the largest."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return max(gathered, key=lambda t: t[0].item()).tolist()


def _benchmark_rank(ctx: RankContext, setting: FsdpSetting) -> FsdpRun:
    work = build_workload(ctx, setting)
    free = available_memory_bytes(ctx.device.type, ctx.device.index or 0)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 1
    free_per_rank = (free or 0) / ranks_per_memory(ctx.device.type, ctx.local_world_size, gpus)

    configs: dict[str, Configuration] = {}
    for name in CONFIGURATIONS:
        configs[name] = build_configuration(name, work.module)
        for _ in range(setting.warmup_steps):
            timed_step(configs[name], work, ctx.device)
    names = list(CONFIGURATIONS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(setting.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(setting.steps_per_round):
                times[name].append(timed_step(configs[name], work, ctx.device))

    small = small_tensor_device(ctx.device, ctx.backend)
    measured = {}
    for name in names:
        values, accounting = _count_step(configs[name], work, ctx.device)
        measured[name] = Measured(
            step_times_s=slowest_rank(times[name], small),
            memory=_largest_rank_values(values, small),
            payload_bytes=dict(accounting.payload_bytes),
            calls=dict(accounting.calls),
            mode=configs[name].model.mode if name == FSDP else None,
        )
    timelines = {}
    for name in TRACED:
        sync_device(ctx.device)
        dist.barrier()
        tracer = StepTracer(time.perf_counter())
        with tracer:
            phases = configs[name].step(work)
        sync_device(ctx.device)
        dist.barrier()  # every collective of the step completed on every rank, callbacks included
        timelines[name] = tracer.timeline(phases, statistics.median(measured[name].step_times_s))
    n_parameters = sum(p.numel() for p in work.module.parameters())
    records = summarize(measured, timelines, setting, n_parameters=n_parameters,
                        parameter_bytes=sum(p.numel() * p.element_size() for p in work.module.parameters()),
                        free_per_rank=free_per_rank, world_size=ctx.world_size)
    return FsdpRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank,
                   n_parameters=n_parameters)


def run_fsdp_benchmark(setting: FsdpSetting) -> FsdpRun:
    """Run the benchmark: spawn the ranks here, or be one rank under torchrun/SLURM.

    ValueError for a setting that cannot run (before any process starts); every rank returns
    the same timings (slowest rank per step) and memory (largest rank's).
    """
    return run_setting(_benchmark_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
