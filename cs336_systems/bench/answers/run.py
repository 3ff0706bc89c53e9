"""The answers' step benchmark: every technique's answer, library and torch, interleaved.

One process group trains the LM with each (technique, implementation), each on its own copy of
the model with AdamW, built and warmed up once. The timed steps run round by round, every
configuration once per round, the order rotated by one each round (as the FSDP benchmark does:
a noisy machine's drift hits all alike). Each timed step starts after a barrier; its time is the
slowest rank's. The paired difference from the library's step of the same technique, per round,
gives each answer's and torch's cost beside the library with a sign-test interval.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from cs336_systems import cli
from cs336_systems.answers.ddp_bucketed import DDPBucketed
from cs336_systems.answers.ddp_overlap_individual_parameters import DDPIndividualParameters
from cs336_systems.answers.fsdp import FSDP as AnswerFSDP
from cs336_systems.answers.sharded_optimizer import ShardedOptimizer as AnswerShardedOptimizer
from cs336_systems.bench.answers.record import AnswersStepRecord
from cs336_systems.bench.fsdp.configurations import LR, Configuration, build_configuration
from cs336_systems.bench.fsdp.formulas import FSDP, TORCH_FSDP
from cs336_systems.bench.fsdp.run import timed_step
from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.stats import median_interval, paired_median
from cs336_systems.bench.workload import Workload, WorkloadSetting, build_workload
from cs336_systems.comm.timing import slowest_rank, small_tensor_device
from cs336_systems.ddp import VARIANTS, BucketedDDP
from cs336_systems.ddp.auto_bucket import DEFAULT_BUCKET_MB
from cs336_systems.launch import RankContext, run_setting
from cs336_systems.zero import ShardedOptimizer

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600
IMPLEMENTATIONS = ("answer", "library", "torch")
TECHNIQUES = ("per-parameter DDP", "bucketed DDP", "sharded optimizer", "FSDP")
DESCRIPTIONS = {
    ("per-parameter DDP", "answer"): "answers/ddp_overlap_individual_parameters.py",
    ("per-parameter DDP", "library"): "ddp.PerParameterDDP",
    ("per-parameter DDP", "torch"): "DistributedDataParallel at its defaults",
    ("bucketed DDP", "answer"): f"answers/ddp_bucketed.py, {DEFAULT_BUCKET_MB:g} MB buckets",
    ("bucketed DDP", "library"): f"ddp.BucketedDDP, {DEFAULT_BUCKET_MB:g} MB buckets",
    ("bucketed DDP", "torch"): f"DistributedDataParallel, bucket_cap_mb={DEFAULT_BUCKET_MB:g}",
    ("sharded optimizer", "answer"): "answers/sharded_optimizer.py over AdamW, under torch's DDP",
    ("sharded optimizer", "library"): "zero.ShardedOptimizer over AdamW, under torch's DDP",
    ("sharded optimizer", "torch"): "ZeroRedundancyOptimizer over AdamW, under torch's DDP",
    ("FSDP", "answer"): "answers/fsdp.py",
    ("FSDP", "library"): "fsdp.FullyShardedDataParallel (reduce-scatter mode)",
    ("FSDP", "torch"): "fully_shard per block and on the model",
}


@dataclass(frozen=True)
class AnswersSetting(WorkloadSetting):
    """The workload and how its twelve configurations are timed."""

    rounds: int = field(default=8, metadata=cli.count(
        "interleaved rounds: each times every configuration once, the order rotated by one each round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each configuration before it is first timed", minimum=0))


def _torch_ddp(module: nn.Module, **options) -> DistributedDataParallel:
    device = next(module.parameters()).device
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None, **options)


def _ddp_configuration(name: str, ddp: nn.Module, module: nn.Module, optimizer=None) -> Configuration:
    finish = getattr(ddp, "finish_gradient_synchronization", None)  # torch's DDP finishes inside backward
    optimizer = optimizer or torch.optim.AdamW(module.parameters(), lr=LR)
    return Configuration(name, ddp, module, optimizer, finish)


def build(technique: str, implementation: str, base: nn.Module) -> Configuration:
    """One configuration on a copy of ``base`` (collective: every rank builds alike, in order)."""
    if technique == "FSDP" and implementation != "answer":  # the FSDP benchmark's own configurations
        return build_configuration(FSDP if implementation == "library" else TORCH_FSDP, base)
    module = copy.deepcopy(base)
    name = f"{technique}/{implementation}"
    if technique == "per-parameter DDP":
        wrap = {"answer": DDPIndividualParameters, "library": VARIANTS["per-parameter"].wrap, "torch": _torch_ddp}
        return _ddp_configuration(name, wrap[implementation](module), module)
    if technique == "bucketed DDP":
        ddp = {"answer": lambda m: DDPBucketed(m, DEFAULT_BUCKET_MB),
               "library": lambda m: BucketedDDP(m, bucket_size_mb=DEFAULT_BUCKET_MB),
               "torch": lambda m: _torch_ddp(m, bucket_cap_mb=DEFAULT_BUCKET_MB)}[implementation](module)
        return _ddp_configuration(name, ddp, module)
    if technique == "sharded optimizer":
        params = module.parameters()
        optimizer = {"answer": lambda: AnswerShardedOptimizer(params, torch.optim.AdamW, lr=LR),
                     "library": lambda: ShardedOptimizer(params, torch.optim.AdamW, lr=LR),
                     "torch": lambda: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)}
        return _ddp_configuration(name, _torch_ddp(module), module, optimizer[implementation]())
    if technique == "FSDP":
        fsdp = AnswerFSDP(module)
        return Configuration(name, fsdp, module, torch.optim.AdamW(fsdp.parameters(), lr=LR),
                             fsdp.finish_gradient_synchronization)
    raise ValueError(f"unknown technique {technique!r}; known: {', '.join(TECHNIQUES)}")


def _records(times: dict[tuple[str, str], list[float]]) -> list[AnswersStepRecord]:
    records = []
    for (technique, implementation), steps in times.items():
        library = times[(technique, "library")]
        vs, vs_ci = (None, None) if implementation == "library" else paired_median(steps, library)
        ci = median_interval(steps)
        records.append(AnswersStepRecord(
            technique, implementation, DESCRIPTIONS[(technique, implementation)], steps, statistics.median(steps),
            list(ci) if ci else None, vs, list(vs_ci) if vs_ci else None))
    return records


def _benchmark_rank(ctx: RankContext, setting: AnswersSetting) -> BenchmarkRun:
    work = build_workload(ctx, setting)
    keys = [(t, i) for t in TECHNIQUES for i in IMPLEMENTATIONS]
    configs = {}
    for key in keys:
        configs[key] = build(*key, work.module)
        for _ in range(setting.warmup_steps):
            timed_step(configs[key], work, ctx.device)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for r in range(setting.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(timed_step(configs[key], work, ctx.device))
    small = small_tensor_device(ctx.device, ctx.backend)
    slowest = {key: slowest_rank(steps, small) for key, steps in times.items()}
    return BenchmarkRun(records=_records(slowest), world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank)


def run_answers_benchmark(setting: AnswersSetting) -> BenchmarkRun:
    """Run it: spawn the ranks here, or be one rank under torchrun/SLURM; every rank returns the
    same records (slowest rank per step)."""
    return run_setting(_benchmark_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
