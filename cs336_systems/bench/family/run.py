"""Timing the family: for each model, the step benchmark's variants interleaved round by round.

One process group runs every model in turn. For each, the variants wrap one module and one
optimizer, as in the step benchmark (``cs336_systems/bench/step``), whose variant builder and
training step are reused here: each step starts after a barrier and its time is the slowest
rank's; round ``r`` times every variant once, the order rotated by ``r``. ``bucketed-auto`` is
warmed up through its tuning steps (AutoBucketedDDP's docstring says how many) before the usual
warm-up, so its timed steps use the cap it kept, as a long training run would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.family.models import FAMILY, FamilyMember
from cs336_systems.bench.family.record import FamilyRecord
from cs336_systems.bench.family.setting import FamilySetting
from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.run import timed_step, warm_up
from cs336_systems.bench.step.variants import AUTO, BUCKETED_PREFIX, COMPUTE_ONLY, TORCH_DDP, bucketed_name, build_variant
from cs336_systems.bench.workload import Workload, shard_rows
from cs336_systems.comm.timing import slowest_rank, small_tensor_device
from cs336_systems.ddp import AutoBucketedDDP, BucketedDDP
from cs336_systems.ddp.auto_bucket import DEFAULT_BUCKET_BYTES
from cs336_systems.launch import RankContext, run_setting
from cs336_systems.units import MB

AUTO_VARIANT = BUCKETED_PREFIX + AUTO
DEFAULT_VARIANT = bucketed_name(DEFAULT_BUCKET_BYTES / MB)
FAMILY_VARIANTS = (COMPUTE_ONLY, AUTO_VARIANT, DEFAULT_VARIANT, TORCH_DDP)
RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600


@dataclass(frozen=True)
class FamilyRun(BenchmarkRun):
    """A finished run, as one process sees it."""

    threads_per_rank: int = 1  # torch's intra-op threads on each rank

    @property
    def notes(self) -> dict:
        """Run-level figures for the results file."""
        return {"threads_per_rank": self.threads_per_rank}


def _workload(ctx: RankContext, member: FamilyMember, seed: int) -> Workload:
    """The seeded model on ``ctx.device`` and this rank's rows of the seeded batch."""
    torch.manual_seed(seed)
    module = member.build().to(ctx.device)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, member.vocab, (member.global_batch, member.context_length + 1), generator=g)
    rows = shard_rows(member.global_batch, ctx.rank, ctx.world_size)
    return Workload(None, module, data[rows, :-1].to(ctx.device), data[rows, 1:].to(ctx.device))


def _time_member(ctx: RankContext, member: FamilyMember, setting: FamilySetting) -> FamilyRecord:
    work = _workload(ctx, member, setting.seed)
    optimizer = torch.optim.AdamW(work.module.parameters(), lr=1e-4)
    variants, tuning_steps = {}, 0
    for name in FAMILY_VARIANTS:
        variant = build_variant(name, work.module, ctx)
        tuning_steps += warm_up(variant, optimizer, work, ctx.device, setting.warmup_steps)
        variants[name] = variant
    steps: dict[str, list[float]] = {name: [] for name in FAMILY_VARIANTS}
    syncs: dict[str, list[float]] = {name: [] for name in FAMILY_VARIANTS}
    names = list(FAMILY_VARIANTS)
    for r in range(setting.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            step_s, sync_s = timed_step(variants[name], optimizer, work, ctx.device)
            steps[name].append(step_s)
            syncs[name].append(sync_s)
    small = small_tensor_device(ctx.device, ctx.backend)
    slowest = {name: slowest_rank(steps[name], small) for name in names}
    records = []
    for name in names:
        wrapper = variants[name].wrapper
        buckets: dict[str, Any] = {}
        if isinstance(wrapper, BucketedDDP):
            cap = wrapper.bucket_cap_bytes
            buckets = {"n_buckets": len(wrapper.buckets), "bucket_cap_bytes": cap if math.isfinite(cap) else None,
                       "bucket_bytes": [b.payload_bytes for b in wrapper.buckets]}
        records.append(StepRecord.from_steps(
            name, slowest[name], slowest[COMPUTE_ONLY], member.global_batch * member.context_length,
            sync_times_s=slowest_rank(syncs[name], small) if wrapper is not None else None,
            allreduce_calls_per_step=wrapper.allreduce_calls_last_step if wrapper is not None else None,
            **buckets,
        ))
        if wrapper is not None:
            wrapper.detach()
    auto = variants[AUTO_VARIANT].wrapper
    assert isinstance(auto, AutoBucketedDDP), f"{AUTO_VARIANT} is built as AutoBucketedDDP"
    sizes = [p.numel() * p.element_size() for p in work.module.parameters() if p.requires_grad]
    tuned = auto.tuning_result
    assert tuned is not None and auto.calibration is not None and auto.model_cap_bytes is not None
    return family_record(
        member, records, n_parameters=sum(p.numel() for p in work.module.parameters()), n_tensors=len(sizes),
        gradient_bytes=sum(sizes), largest_parameter_bytes=max(sizes), calibration_o_s=auto.calibration.o_s,
        calibration_w_bytes_per_s=auto.calibration.w_bytes_per_s, model_cap_bytes=auto.model_cap_bytes,
        candidate_caps_bytes=list(tuned.caps), candidate_median_s=[None if math.isnan(m) else m for m in tuned.median_s],
        chosen_cap_bytes=tuned.chosen_cap, tuning_steps=tuning_steps,
    )


def _family_rank(ctx: RankContext, setting: FamilySetting) -> FamilyRun:
    threads = ctx.share_cpu_threads()
    records = [_time_member(ctx, FAMILY[name], setting) for name in setting.models]
    return FamilyRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank,
                     threads_per_rank=threads)


def family_record(member: FamilyMember, steps: list[StepRecord], **measured: Any) -> FamilyRecord:
    """A model's record: its variants' step records, auto − 25 MB paired round by round, and
    ``measured``, the remaining fields as the ranks measured them (sizes, what auto chose)."""
    by = {r.variant: r for r in steps}
    difference, interval = paired_median(by[AUTO_VARIANT].step_times_s, by[DEFAULT_VARIANT].step_times_s)
    return FamilyRecord(
        model=member.name, shape=member.shape, context_length=member.context_length, global_batch=member.global_batch,
        steps=steps, auto_minus_default_s=difference, auto_minus_default_ci95_s=list(interval) if interval else None,
        **measured,
    )


def run_family_benchmark(setting: FamilySetting) -> FamilyRun:
    """Run the family: spawn the ranks here, or be one rank under torchrun/SLURM.

    ValueError for a setting that cannot run (before any process starts); every rank returns
    the same figures (slowest rank per step).
    """
    return run_setting(_family_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
