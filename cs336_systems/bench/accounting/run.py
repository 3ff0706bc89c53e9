"""The accounting on every rank: each configuration's memory, then both timed in interleaved rounds.

Both configurations synchronise gradients with :class:`~cs336_systems.ddp.NaiveDDP`, which
all-reduces each ``.grad`` in place and so holds no gradient copy (a flat or bucketed wrapper
keeps buffers, which would blur the breakdown); they differ only in the optimizer. On each rank,
in one process group:

1. Warm-up (:func:`_warm_up`): one untimed step of each configuration on a throwaway model,
   because the first use of torch's kernels and of each collective pages in code and allocates
   runtime buffers (about 160 MiB of RSS on a CPU, once per process). It is a function that
   returns nothing, so that nothing of the throwaway model outlives it; the baselines check it
   (``baseline_live_tensor_bytes``: the tensors Python can still reach, 0 when nothing leaked).
2. Memory (:func:`_measure_memory`), one configuration after the other: the level before the
   model is built is the baseline; then the peak and the level after the model is built, after
   it is wrapped and its optimizer built, directly before ``optimizer.step()`` and directly
   after it, on the last of ``warmup_steps + 1`` steps, each broken down into parameters,
   gradients, optimizer state and the rest.
3. Time (:func:`_time_rounds`): one model and both optimizers over its parameters; each round
   times one step of each configuration, their order alternating from round to round, so that
   step ``i`` of both ran seconds apart under the same machine load (see bench/stats.py). Every
   time is the slowest rank's.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.accounting.counting import (
    expected_adam_state_bytes,
    live_tensor_bytes,
    optimizer_state_bytes,
    storage_bytes,
)
from cs336_systems.bench.accounting.meters import Meter, fix_malloc_mmap_threshold, meter_for
from cs336_systems.bench.accounting.record import CONFIGURATIONS, SHARDED, AccountingRecord, PhaseMemory
from cs336_systems.bench.accounting.setting import AccountingSetting
from cs336_systems.bench.workload import Workload, build_workload
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.ddp import NaiveDDP
from cs336_systems.launch import RankContext, run_setting
from cs336_systems.zero import ShardedOptimizer


# Draw the weights on a GPU itself: the run builds its model four times, and xl's two billion
# weights take tens of seconds each time on a CPU. On a CPU, as always.
_ON_DEVICE = {"cuda": True, "cpu": False}


@dataclass(frozen=True)
class AccountingRun(BenchmarkRun):
    """A finished run, as one process sees it: every (configuration, rank) record, configurations in
    order, ranks ascending."""

    @property
    def notes(self) -> dict:
        """Run-level figures for the results file."""
        return {"n_parameters": self.records[0].n_parameters}


def make_optimizer(
    configuration: str, module: torch.nn.Module, setting: AccountingSetting
) -> torch.optim.Optimizer:
    """AdamW over every parameter, or a ShardedOptimizer over AdamW ("sharded")."""
    params = list(module.parameters())
    if configuration == SHARDED:
        return ShardedOptimizer(params, torch.optim.AdamW, bucket_size_mb=setting.bucket_size_mb, lr=setting.lr)
    return torch.optim.AdamW(params, lr=setting.lr)


def owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose optimizer state this rank keeps."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.owned_parameters()
    return [p for group in optimizer.param_groups for p in group["params"]]


def _forward_backward(model: NaiveDDP, workload: Workload) -> None:
    logits = model(workload.tokens)
    F.cross_entropy(logits.flatten(0, 1), workload.targets.flatten()).backward()
    del logits  # dead after backward: keep it out of the level read before the step
    model.finish_gradient_synchronization()


def _settle(ctx: RankContext) -> None:
    """Free what is unreachable, wait for the device, and line the ranks up."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    sync_device(ctx.device)
    dist.barrier()


def _warm_up(ctx: RankContext, setting: AccountingSetting) -> None:
    """One untimed step of each configuration on a throwaway model; nothing of it survives."""
    workload = build_workload(ctx, setting, init_on_device=_ON_DEVICE[ctx.device.type])
    model = NaiveDDP(workload.module)
    for configuration in CONFIGURATIONS:
        optimizer = make_optimizer(configuration, workload.module, setting)
        optimizer.zero_grad(set_to_none=True)
        _forward_backward(model, workload)
        optimizer.step()


def _phase(
    meter: Meter, baseline: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> PhaseMemory:
    peak, current = meter.read()
    params = list(module.parameters())
    counted = {
        "parameters_bytes": storage_bytes(params),
        "gradients_bytes": storage_bytes(p.grad for p in params),
        "optimizer_state_bytes": 0 if optimizer is None else optimizer_state_bytes(optimizer),
    }
    return PhaseMemory(
        peak_above_baseline_bytes=peak - baseline,
        current_above_baseline_bytes=None if current is None else current - baseline,
        other_bytes=peak - baseline - sum(counted.values()),
        **counted,
    )


def _measure_memory(ctx: RankContext, setting: AccountingSetting, configuration: str, meter: Meter) -> dict:
    """The record's memory and byte-count fields for ``configuration`` on this rank."""
    _settle(ctx)
    live = live_tensor_bytes()
    meter.reset_peak()
    baseline = meter.read()[1] or 0
    workload = build_workload(ctx, setting, init_on_device=_ON_DEVICE[ctx.device.type])
    module = workload.module
    phases = {"after_model": _phase(meter, baseline, module, None)}
    meter.reset_peak()
    model = NaiveDDP(module)
    optimizer = make_optimizer(configuration, module, setting)
    phases["after_init"] = _phase(meter, baseline, module, optimizer)
    for _ in range(setting.warmup_steps + 1):
        sync_device(ctx.device)
        meter.reset_peak()
        optimizer.zero_grad(set_to_none=True)
        _forward_backward(model, workload)
        sync_device(ctx.device)
        phases["before_step"] = _phase(meter, baseline, module, optimizer)
        meter.reset_peak()
        optimizer.step()
        sync_device(ctx.device)
        phases["after_step"] = _phase(meter, baseline, module, optimizer)

    params = list(module.parameters())
    parameter_bytes = storage_bytes(params)
    largest = max(storage_bytes([p]) for p in params)
    owned = owned_parameters(optimizer)
    sharded = configuration == SHARDED
    return dict(
        baseline_bytes=baseline,
        baseline_live_tensor_bytes=live,
        **phases,
        n_parameters=sum(p.numel() for p in params),
        n_parameter_tensors=len(params),
        parameter_bytes=parameter_bytes,
        largest_parameter_bytes=largest,
        owned_parameters=len(owned),
        owned_parameter_bytes=storage_bytes(owned),
        optimizer_state_bytes=phases["after_step"].optimizer_state_bytes,
        expected_optimizer_state_bytes=expected_adam_state_bytes(parameter_bytes, ctx.world_size, sharded),
        optimizer_state_imbalance_bound_bytes=2 * largest if sharded else 0,
        broadcast_received_bytes=parameter_bytes - storage_bytes(owned) if sharded else 0,
    )


def _timed_step(
    ctx: RankContext, model: NaiveDDP, optimizer: torch.optim.Optimizer, workload: Workload
) -> tuple[float, float]:
    """(whole step, optimizer.step() alone) in seconds, on this rank."""
    sync_device(ctx.device)
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    _forward_backward(model, workload)
    sync_device(ctx.device)
    step_start = time.perf_counter()
    optimizer.step()
    sync_device(ctx.device)
    done = time.perf_counter()
    return done - start, done - step_start


def _time_rounds(ctx: RankContext, setting: AccountingSetting) -> dict[str, tuple[list[float], list[float]]]:
    """Per configuration: (step times, optimizer-step times), slowest rank, one per timed round."""
    workload = build_workload(ctx, setting, init_on_device=_ON_DEVICE[ctx.device.type])
    model = NaiveDDP(workload.module)
    # Both optimizers update the one model: step times do not depend on the values.
    optimizers = {c: make_optimizer(c, workload.module, setting) for c in CONFIGURATIONS}
    local: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in CONFIGURATIONS}
    for round_index in range(setting.warmup_steps + setting.steps):
        order = CONFIGURATIONS if round_index % 2 == 0 else CONFIGURATIONS[::-1]
        for configuration in order:
            step_s, optimizer_s = _timed_step(ctx, model, optimizers[configuration], workload)
            if round_index >= setting.warmup_steps:
                local[configuration][0].append(step_s)
                local[configuration][1].append(optimizer_s)
    flat = [t for c in CONFIGURATIONS for series in local[c] for t in series]
    slowest = slowest_rank(flat, small_tensor_device(ctx.device, ctx.backend))
    n = setting.steps
    return {c: (slowest[2 * i * n : (2 * i + 1) * n], slowest[(2 * i + 1) * n : (2 * i + 2) * n])
            for i, c in enumerate(CONFIGURATIONS)}


def accounting_rank(ctx: RankContext, setting: AccountingSetting) -> AccountingRun:
    """The whole run on this rank; every rank gathers every rank's records."""
    ctx.share_cpu_threads()
    # Only RSS needs freed memory handed back; the CUDA allocator counts live tensors itself.
    malloc_threshold = fix_malloc_mmap_threshold() if ctx.device.type == "cpu" else None
    meter = meter_for(ctx.device)
    _warm_up(ctx, setting)
    memory = {c: _measure_memory(ctx, setting, c, meter) for c in CONFIGURATIONS}
    _settle(ctx)
    times = _time_rounds(ctx, setting)
    mine = [
        AccountingRecord(
            configuration=c, rank=ctx.rank, world_size=ctx.world_size, method=meter.method,
            peak_resettable=meter.peak_resettable, malloc_mmap_threshold_bytes=malloc_threshold,
            step_times_s=times[c][0], optimizer_step_times_s=times[c][1], **memory[c],
        )
        for c in CONFIGURATIONS
    ]
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    records = [rank_records[i] for i in range(len(CONFIGURATIONS)) for rank_records in gathered]
    return AccountingRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank)


def run_accounting(setting: AccountingSetting) -> AccountingRun:
    """One record per (configuration, rank), in one process group (spawned here, or this
    process's under torchrun or SLURM)."""
    return run_setting(accounting_rank, setting)
