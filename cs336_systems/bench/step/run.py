"""The interleaved rounds of the DDP step benchmark (problems 3, 4, 5a, 6a).

One process group times full training steps of the Transformer LM (forward, backward,
gradient synchronisation, AdamW step) for each variant (see variants.py). All variants wrap
the *same* module and optimizer, are built once and warmed up once (as a training job builds
its wrapper once; with ``rebuild_each_round``, for models whose gradient buffers fit in memory
only a few times over, our wrappers are instead built, warmed up and dropped within each
round), and run interleaved round by round (round r: a few steps of each variant in turn, the
order rotated by one variant each round so that no variant always follows the same one), so
that drift of a noisy machine (thermal, other tenants) hits all alike. Each step starts after
a barrier; its time is the slowest rank's. The time in gradient synchronisation runs from the
end of backward's own computation (``BackwardClock``) to the end of ``backward()``: every wrapper,
ours as torch's DDP, reduces there, naive's and flat's all-reduces and the overlapped variants'
wait alike (with ``finish_gradient_synchronization``, a no-op since the wrappers sync in backward).

Beside the timed steps (never inside them) the run measures what explains them (probes.py):
flat's pack and unpack copies after each of its steps, and, once at the end, the error of each
narrower communication dtype on one step's gradients.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.step.probes import comm_dtype_error
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.setting import LEARNING_RATE, StepSetting
from cs336_systems.bench.step.variants import (
    COMPUTE_ONLY,
    TORCH_DDP,
    StepVariant,
    build_variant,
    communication_dtype,
)
from cs336_systems.bench.workload import Workload, build_workload
from cs336_systems.comm.timing import (BackwardClock, slowest_rank, small_tensor_device, sync_compute_stream,
                                      sync_device)
from cs336_systems.ddp import AutoBucketedDDP, BucketedDDP
from cs336_systems.launch import RankContext, run_setting

RANK_TIMEOUT_S = 600  # one collective on a loaded machine with a large model
RUN_TIMEOUT_S = 3600  # the whole run


@dataclass
class _Steps:
    """One variant's timed steps on this rank, before the slowest rank is taken per step."""

    times: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    pack: list[float] = field(default_factory=list)  # flat's copies, one per timed step
    unpack: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StepRun(BenchmarkRun):
    """A finished run, as one process sees it."""

    n_parameters: int = 0
    threads_per_rank: int | None = None  # torch's intra-op threads on each rank
    ranks_on_node: int | None = None  # ranks sharing this machine's cores (and GPUs)
    host_memory_bytes: int | None = None  # physical memory of this machine

    @property
    def notes(self) -> dict:
        """Run-level figures for the results file (the writeup states the setting from them)."""
        found = {"n_parameters": self.n_parameters, "threads_per_rank": self.threads_per_rank,
                 "ranks_on_node": self.ranks_on_node, "host_memory_bytes": self.host_memory_bytes}
        return {k: v for k, v in found.items() if v is not None}


def host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def warm_up(variant: StepVariant, optimizer: torch.optim.Optimizer, work: Workload, device: torch.device,
            steps: int) -> int:
    """Untimed steps before a variant is first timed: through ``bucket_size_mb="auto"``'s tuning
    (its steps choose the buckets, they are not steady state), then ``steps`` more. Returns the
    number of tuning steps."""
    tuning_steps = 0
    while isinstance(variant.wrapper, AutoBucketedDDP) and variant.wrapper.tuning:
        timed_step(variant, optimizer, work, device)
        tuning_steps += 1
    for _ in range(steps):
        timed_step(variant, optimizer, work, device)
    return tuning_steps


def timed_step(variant: StepVariant, optimizer: torch.optim.Optimizer, work: Workload,
                device: torch.device) -> tuple[float, float]:
    """One training step; returns (step seconds, seconds in gradient synchronisation)."""
    sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = variant.model(work.tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), work.targets.flatten())
    clock = BackwardClock(device)  # the compute stream only: communication in flight stays outstanding
    clock.watch(loss)
    loss.backward()
    if variant.finish is not None:
        variant.finish()
    sync_compute_stream(device)
    sync_done = time.perf_counter()
    backward_done = clock.compute_end if clock.compute_end is not None else sync_done
    optimizer.step()
    sync_device(device)
    return time.perf_counter() - start, sync_done - backward_done


def _torch_ddp_bucket_count(model: nn.Module) -> int | None:
    """Buckets torch's DDP reduces per step (one all-reduce each), from its logging data.

    At construction torch's DDP may put every parameter in one bucket and rebuild the buckets
    in gradient-ready order after the first backward (``bucket_cap_mb`` applies from then on),
    so the rebuilt layout, where there is one, is the one each timed step uses.
    ``_get_ddp_logging_data`` is private; if a torch version lacks it, report nothing.
    """
    try:
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    if not sizes:
        return None
    return len(str(sizes).split(","))


def _retire(variant: StepVariant, steps: _Steps, names: dict[int, str]) -> dict[str, Any]:
    """Detach a variant; returns its bucket layout as :class:`StepRecord` fields (``names``:
    parameter id -> name), none for a variant without buckets."""
    layout: dict[str, Any] = {}
    wrapper = variant.wrapper
    if isinstance(wrapper, BucketedDDP):
        layout = {
            "n_buckets": len(wrapper.buckets),
            "bucket_bytes": [bucket.payload_bytes for bucket in wrapper.buckets],
            "bucket_params": [[names[id(p)] for p in bucket.params] for bucket in wrapper.buckets],
            "bucket_cap_bytes": wrapper.bucket_cap_bytes if math.isfinite(wrapper.bucket_cap_bytes) else None,
            "first_bucket_cap_bytes": wrapper.first_bucket_cap_bytes,
        }
    if variant.name == TORCH_DDP:
        layout = {"n_buckets": _torch_ddp_bucket_count(variant.model)}
        if layout["n_buckets"] is not None:
            steps.calls.append(layout["n_buckets"])
    if wrapper is not None:
        wrapper.detach()
    return layout


def _local_backward(work: Workload) -> None:
    """One forward and backward of the bare module: every rank's own, unsynchronised gradients."""
    work.module.zero_grad(set_to_none=True)
    logits = work.module(work.tokens)
    F.cross_entropy(logits.flatten(0, 1), work.targets.flatten()).backward()


def _benchmark_rank(ctx: RankContext, setting: StepSetting) -> StepRun:
    work = build_workload(ctx, setting)
    threads = torch.get_num_threads()
    param_names = {id(p): n for n, p in work.module.named_parameters()}
    optimizer = torch.optim.AdamW(work.module.parameters(), lr=LEARNING_RATE)
    variant_names = setting.variant_names()
    measured = {name: _Steps() for name in variant_names}
    layouts: dict[str, dict[str, Any]] = {}

    # Wrappers stay attached to the shared module for the whole run: each one's hooks act only
    # on backward passes of its own forward (ddp/overlap.py), and torch's reducer ignores
    # backward passes it did not start, so the wrappers do not see each other's steps. Torch's
    # DDP is always built once: rebuilding it would re-register its hooks on the module.
    rebuilt = {n for n in variant_names if setting.rebuild_each_round and n != TORCH_DDP}
    kept = {}
    for name in variant_names:
        if name not in rebuilt:  # warmed up as soon as built, before the next one attaches its hooks
            kept[name] = build_variant(name, work.module, ctx)
            warm_up(kept[name], optimizer, work, ctx.device, setting.warmup_steps)
    for r in range(setting.rounds):
        shift = r % len(variant_names)
        for name in variant_names[shift:] + variant_names[:shift]:
            if name in kept:
                variant = kept[name]
            else:
                variant = build_variant(name, work.module, ctx)
                warm_up(variant, optimizer, work, ctx.device, setting.warmup_steps)
            _time_round(variant, optimizer, work, ctx.device, setting.steps_per_round, measured[name])
            if name in rebuilt:
                layouts[name] = _retire(variant, measured[name], param_names)
    for variant in kept.values():
        layouts[variant.name] = _retire(variant, measured[variant.name], param_names)
    kept.clear()

    # Every wrapper is detached now: one bare backward gives the local gradients that each
    # narrower communication dtype is judged on (the same gradients for every dtype).
    comm_errors: dict[str, float] = {}
    narrow = {name: communication_dtype(name) for name in variant_names}
    if any(dtype is not None for dtype in narrow.values()):
        _local_backward(work)
        params = [p for p in work.module.parameters() if p.requires_grad]
        comm_errors = {name: comm_dtype_error(params, dtype) for name, dtype in narrow.items() if dtype is not None}
        work.module.zero_grad(set_to_none=True)

    small = small_tensor_device(ctx.device, ctx.backend)
    step_times = {name: slowest_rank(measured[name].times, small) for name in variant_names}
    records = []
    for name in variant_names:
        m = measured[name]
        has_sync_phase = name not in (COMPUTE_ONLY, TORCH_DDP)  # the same on every rank
        records.append(StepRecord.from_steps(
            name, step_times[name], step_times[COMPUTE_ONLY], setting.tokens_per_step,
            steps_per_round=setting.steps_per_round,
            sync_times_s=slowest_rank(m.sync, small) if has_sync_phase else None,
            allreduce_calls_per_step=statistics.median(m.calls) if m.calls else None,
            pack_times_s=slowest_rank(m.pack, small) if m.pack else None,
            unpack_times_s=slowest_rank(m.unpack, small) if m.unpack else None,
            comm_error_rel=comm_errors.get(name),
            **layouts[name],
        ))
    return StepRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank,
                   n_parameters=sum(p.numel() for p in work.module.parameters()), threads_per_rank=threads,
                   ranks_on_node=ctx.local_world_size, host_memory_bytes=host_memory_bytes())


def _time_round(variant: StepVariant, optimizer: torch.optim.Optimizer, work: Workload, device: torch.device,
                steps: int, measured: _Steps) -> None:
    """One round's timed steps of ``variant``, each followed by what is probed beside it."""
    for _ in range(steps):
        step_s, sync_s = timed_step(variant, optimizer, work, device)
        measured.times.append(step_s)
        measured.sync.append(sync_s)
        if variant.wrapper is not None:
            measured.calls.append(variant.wrapper.allreduce_calls_last_step)
        if variant.copy_probe is not None:
            pack_s, unpack_s = variant.copy_probe.time_copies(device)
            measured.pack.append(pack_s)
            measured.unpack.append(unpack_s)


def run_step_benchmark(setting: StepSetting) -> StepRun:
    """Run the benchmark: spawn the ranks here, or be one rank under torchrun/SLURM.

    ValueError for a setting that cannot run (before any process starts); every rank returns
    the same figures (slowest rank per step).
    """
    return run_setting(_benchmark_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
