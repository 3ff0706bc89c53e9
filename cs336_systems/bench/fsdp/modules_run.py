"""The FSDP modules benchmark: our ``fully_shard`` beside torch's on the models of modules.py.

Every case is built on both sides from the same seeded weights and sharded in place (each side
its own copy), and warmed up; then the timed steps run interleaved round by round over every
(case, side) pair, the order rotated by one pair each round, each step after a barrier, its time
the slowest rank's (run.py's ``timed_step``). Per case the record gives the median over rounds
of our step / torch's step in the same round, with its distribution-free 95% interval
(bench/stats.py), so the machine's drift cancels. Then one untimed step of each side under the
counting mode (accounting.py): the bytes each rank holds between steps (parameter shards, their
gradients, AdamW's state) and the step's peak, the largest rank's. Last, both sides having taken
the same steps on the same batch, the largest difference between their full weights: a check
that the two trained the same model, not a tolerance test (tests/test_fsdp_any_module.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from cs336_systems import cli
from cs336_systems.bench.fsdp.accounting import StepAccounting
from cs336_systems.bench.fsdp.configurations import Configuration
from cs336_systems.bench.fsdp.modules import (
    CASES, EPS, OURS, TORCH, ModelShape, ModuleCase, batch, build, full_params, shard, trained,
)
from cs336_systems.bench.fsdp.run import timed_step
from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.stats import median_interval
from cs336_systems.bench.workload import Workload, shard_rows
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.launch import RankContext, run_setting
from cs336_systems.launch.setting import LaunchSetting
from cs336_systems.results.schema import Record

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600
LR = 1e-4
SIDES = (OURS, TORCH)


@dataclass(frozen=True)
class FsdpModulesSetting(LaunchSetting):
    """The cases' model shape, the batch, and how the (case, side) pairs are timed."""

    d_model: int = field(default=128, metadata=cli.count("width of every case's model"))
    num_heads: int = field(default=4, metadata=cli.count("attention heads (they must divide --d-model)"))
    d_ff: int = field(default=512, metadata=cli.count("inner width of each block's feed-forward"))
    num_layers: int = field(default=4, metadata=cli.count("blocks of every case's model"))
    vocab_size: int = field(default=1024, metadata=cli.count("tokens of the tied LM"))
    context_length: int = field(default=64, metadata=cli.count("positions per sequence"))
    global_batch: int = field(default=6, metadata=cli.count("sequences per step over all ranks"))
    seed: int = field(default=0, metadata=cli.count("seed of the weights and the data", minimum=0))
    rounds: int = field(default=16, metadata=cli.count(
        "interleaved rounds: each times every case on both sides, the order rotated each round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each case and side before it is first timed", minimum=0))

    @property
    def results_suffix(self) -> str | None:
        """fsdp_modules.json at 2 ranks, fsdp_modules-ws<n>.json at n ranks otherwise."""
        return None if self.ranks == 2 else f"ws{self.ranks}"

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.d_model, self.num_heads, self.d_ff, self.num_layers, self.vocab_size)

    def validate(self) -> None:
        super().validate()
        if self.d_model % self.num_heads:
            raise ValueError(f"--num-heads {self.num_heads} does not divide --d-model {self.d_model}")
        shard_rows(self.global_batch, 0, self.ranks)


@dataclass(frozen=True)
class FsdpModuleRecord(Record):
    """One case: our step time beside torch's, the bytes each holds, and how far their weights ended."""

    KIND: ClassVar[str] = "fsdp_modules"
    VERSION: ClassVar[int] = 1

    case: str  # a ModuleCase's name (modules.py)
    description: str
    world_size: int
    n_parameters: int  # the model's parameters (a tied weight once)
    ours_step_times_s: list[float]  # slowest rank per timed step, round order
    torch_step_times_s: list[float]  # entry i timed in the same round as ours'
    ours_median_s: float
    torch_median_s: float
    ratio_median: float  # median over rounds of ours / torch's (<= 1: ours no slower)
    ratio_ci95: list[float] | None  # its 95% interval; None: too few rounds
    # The largest rank's, over one counted step.
    ours_resident_bytes: float  # held between steps: shards, their gradients, AdamW's state
    torch_resident_bytes: float
    ours_peak_bytes: float
    torch_peak_bytes: float
    max_weight_difference: float  # max |ours - torch's| over every weight after the same steps


def _build_side(case: ModuleCase, side: str, setting: FsdpModulesSetting, device: torch.device) -> Configuration:
    model = shard(case, side, build(case, setting.shape, setting.seed).to(device))
    optimizer = torch.optim.AdamW(trained(model), lr=LR, eps=EPS)
    return Configuration(f"{case.name}/{side}", model, model, optimizer, None)


def _work(ctx: RankContext, case: ModuleCase, setting: FsdpModulesSetting, module: torch.nn.Module) -> Workload:
    """This rank's rows of the case's global batch (float inputs, or tokens for the tied LM)."""
    inputs, targets = batch(case, setting.shape, setting.global_batch, setting.context_length, setting.seed)
    rows = shard_rows(setting.global_batch, ctx.rank, ctx.world_size)
    return Workload(None, module, inputs[rows].to(ctx.device), targets[rows].to(ctx.device))


def _counted(config: Configuration, work: Workload, device: torch.device) -> list[float]:
    """[bytes held between steps, the step's peak] over one step under the counting mode."""
    sync_device(device)
    accounting = StepAccounting(config)
    with accounting:
        config.step(work)
    sync_device(device)
    return [accounting.resident_bytes, accounting.peak_bytes]


def _weight_difference(ours: Configuration, theirs: Configuration) -> float:
    a, b = full_params(OURS, ours.model), full_params(TORCH, theirs.model)
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def _benchmark_rank(ctx: RankContext, setting: FsdpModulesSetting) -> BenchmarkRun:
    ctx.share_cpu_threads()
    works: dict[str, Workload] = {}
    sides: dict[tuple[str, str], Configuration] = {}
    for case in CASES:
        for side in SIDES:
            sides[(case.name, side)] = built = _build_side(case, side, setting, ctx.device)
            works.setdefault(case.name, _work(ctx, case, setting, built.module))
            for _ in range(setting.warmup_steps):
                timed_step(built, works[case.name], ctx.device)
    keys = list(sides)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for r in range(setting.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(timed_step(sides[key], works[key[0]], ctx.device))

    small = small_tensor_device(ctx.device, ctx.backend)
    records = []
    for case in CASES:
        ours, theirs = sides[(case.name, OURS)], sides[(case.name, TORCH)]
        work = works[case.name]
        ours_values = slowest_rank(_counted(ours, work, ctx.device), small)  # the largest rank's
        torch_values = slowest_rank(_counted(theirs, work, ctx.device), small)
        ours_times = slowest_rank(times[(case.name, OURS)], small)
        torch_times = slowest_rank(times[(case.name, TORCH)], small)
        ratios = [a / b for a, b in zip(ours_times, torch_times)]
        interval = median_interval(ratios)
        records.append(FsdpModuleRecord(
            case=case.name, description=case.description, world_size=ctx.world_size,
            n_parameters=sum(p.numel() for p in build(case, setting.shape, setting.seed).parameters()),
            ours_step_times_s=ours_times, torch_step_times_s=torch_times,
            ours_median_s=statistics.median(ours_times), torch_median_s=statistics.median(torch_times),
            ratio_median=statistics.median(ratios), ratio_ci95=list(interval) if interval else None,
            ours_resident_bytes=ours_values[0], torch_resident_bytes=torch_values[0],
            ours_peak_bytes=ours_values[1], torch_peak_bytes=torch_values[1],
            max_weight_difference=_weight_difference(ours, theirs),
        ))
    for (_, side), config in sides.items():
        if side == OURS:
            config.model.release()
    return BenchmarkRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank)


def run_fsdp_modules_benchmark(setting: FsdpModulesSetting) -> BenchmarkRun:
    """Run it: spawn the ranks here, or be one rank under torchrun/SLURM (every rank returns the
    same records)."""
    return run_setting(_benchmark_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
