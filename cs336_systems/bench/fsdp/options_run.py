"""The FSDP options benchmark: each option on our FSDP beside torch's ``fully_shard``, same run.

For every option of options.py that runs at the world size, both sides are built on copies of
the LM and warmed up; then the timed steps run interleaved round by round over every (option,
side) pair, the order rotated by one pair each round, each step after a barrier, its time the
slowest rank's. Per option the record gives the median over rounds of our step / torch's step
in the same round, with its distribution-free 95% interval (bench/stats.py), so the machine's
drift cancels. Then one untimed step of each side under the counting mode (accounting.py):
bytes held between steps, the step's peak and its activation part, collectives by kind.

The accounting statement: from the shard layouts alone (no measurement), :func:`predict` says
what our side's step moves and holds under the option; the record keeps it beside what was
counted, so the writeup states both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from cs336_systems import cli
from cs336_systems.bench.fsdp.accounting import StepAccounting
from cs336_systems.bench.fsdp.options import OURS, SPECS, TORCH, OptionSide, OptionSpec, build_side, hybrid_mesh
from cs336_systems.bench.fsdp.record import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.stats import median_interval
from cs336_systems.bench.workload import Workload, WorkloadSetting, build_workload
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.launch import RankContext, run_setting
from cs336_systems.results.schema import Record

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600
LR = 1e-4


@dataclass(frozen=True)
class FsdpOptionsSetting(WorkloadSetting):
    """The workload and how its (option, side) pairs are timed."""

    rounds: int = field(default=6, metadata=cli.count(
        "interleaved rounds: each times every option on both sides, the order rotated each round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each option and side before it is first timed", minimum=0))


@dataclass(frozen=True)
class FsdpOptionRecord(Record):
    """One option: our step time beside torch's, bytes held, collectives, and the prediction."""

    KIND: ClassVar[str] = "fsdp_options"
    VERSION: ClassVar[int] = 1

    option: str  # a key of options.SPECS
    description: str
    world_size: int
    ours_step_times_s: list[float]  # slowest rank per timed step, round order
    torch_step_times_s: list[float]  # entry i timed in the same round as ours'
    ours_median_s: float
    torch_median_s: float
    ratio_median: float  # median over rounds of ours / torch's (<= 1: ours no slower)
    ratio_ci95: list[float] | None  # its 95% interval; None: too few rounds
    # Per rank (the largest rank's), over one counted step.
    ours_resident_bytes: float  # held between steps: parameters, optimizer state
    torch_resident_bytes: float
    ours_peak_bytes: float
    torch_peak_bytes: float
    ours_activation_peak_bytes: float  # the activations' part of the peak
    torch_activation_peak_bytes: float
    ours_calls: dict[str, int]  # collective kind -> calls per step (rank 0)
    torch_calls: dict[str, int]
    ours_payload_bytes: dict[str, float]  # collective kind -> bytes per step (rank 0)
    torch_payload_bytes: dict[str, float]
    predicted_payload_bytes: dict[str, float]  # ours, from the shard layouts (predict())
    predicted_resident_bytes: float


@dataclass(frozen=True)
class FsdpOptionsRun(BenchmarkRun):
    n_parameters: int = 0

    @property
    def notes(self) -> dict:
        return {"n_parameters": self.n_parameters}


def predict(side: OptionSide, state_copies: int = 2) -> tuple[dict[str, float], float]:
    """What our FSDP's step moves (bytes by collective kind, rank 0) and holds between steps.

    Per sharded weight of ``padded`` elements (its flattened size rounded up to the shard
    group): forward all-gathers it once per micro-batch in the compute dtype; backward again,
    unless ``reshard_after_forward=False`` or the weight is an embedding (its gradient needs
    no weight); one reduce-scatter per step of the summed gradient in the reduce dtype; with
    replicas, an all-reduce of the shard's gradient. Replicated parameters' gradients: one
    all-reduce. Held between steps: shards and replicated parameters in float32, as much again
    for their gradients (kept until the next step's ``zero_grad``), and ``state_copies`` times
    as much for the optimizer (AdamW: 2 moments, besides a scalar step count per parameter;
    SGD with momentum: 1).
    """
    micro_batches = side.spec.micro_batches
    fsdp = side.model
    spec: OptionSpec = side.spec
    compute = torch.finfo(spec.param_dtype or torch.float32).bits // 8
    reduce = torch.finfo(spec.reduce_dtype or torch.float32).bits // 8
    payload = {ALL_GATHER: 0.0, REDUCE_SCATTER: 0.0, ALL_REDUCE: 0.0}
    embeddings = {id(m.weight) for m in side.module.modules() if type(m).__name__ == "Embedding"}
    shard_numel = 0
    for weight in fsdp.sharded_weights:
        padded = weight.layout.padded_numel
        gathers = 1 if not spec.reshard_after_forward or id(weight.param) in embeddings else 2
        payload[ALL_GATHER] += micro_batches * gathers * padded * compute
        payload[REDUCE_SCATTER] += padded * reduce
        if spec.hybrid:
            payload[ALL_REDUCE] += weight.layout.shard_numel * reduce
        shard_numel += weight.layout.shard_numel
    shards = {id(w.param) for w in fsdp.sharded_weights}
    replicated = sum(p.numel() for p in side.module.parameters() if id(p) not in shards)
    payload[ALL_REDUCE] += replicated * reduce
    return payload, (2 + state_copies) * 4 * (shard_numel + replicated)


def _timed_step(side: OptionSide, work: Workload, device: torch.device) -> float:
    sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    side.step(work.tokens, work.targets)
    sync_device(device)
    return time.perf_counter() - start


def _counted(side: OptionSide, work: Workload, device: torch.device) -> tuple[list[float], StepAccounting]:
    sync_device(device)
    dist.barrier()
    accounting = StepAccounting(side)
    with accounting:
        side.step(work.tokens, work.targets)
    sync_device(device)
    return [accounting.resident_bytes, accounting.peak_bytes, accounting.peak_parts["activations"]], accounting


def _largest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def _benchmark_rank(ctx: RankContext, setting: FsdpOptionsSetting) -> FsdpOptionsRun:
    work = build_workload(ctx, setting)
    rows = work.tokens.shape[0]
    specs = [s for s in SPECS.values() if s.runs_at(ctx.world_size) and rows % s.micro_batches == 0]
    mesh = hybrid_mesh(ctx.device.type) if any(s.hybrid for s in specs) else None

    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=LR)

    sides: dict[tuple[str, str], OptionSide] = {}
    for spec in specs:
        for side in (OURS, TORCH):
            sides[(spec.name, side)] = built = build_side(spec, side, work.module, make_optimizer, mesh=mesh)
            for _ in range(setting.warmup_steps):
                _timed_step(built, work, ctx.device)
    keys = list(sides)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for r in range(setting.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(_timed_step(sides[key], work, ctx.device))

    small = small_tensor_device(ctx.device, ctx.backend)
    records = []
    for spec in specs:
        ours, theirs = sides[(spec.name, OURS)], sides[(spec.name, TORCH)]
        ours_values, ours_acc = _counted(ours, work, ctx.device)
        torch_values, torch_acc = _counted(theirs, work, ctx.device)
        ours_values, torch_values = _largest(ours_values, small), _largest(torch_values, small)
        ours_times = slowest_rank(times[(spec.name, OURS)], small)
        torch_times = slowest_rank(times[(spec.name, TORCH)], small)
        ratios = [a / b for a, b in zip(ours_times, torch_times)]
        interval = median_interval(ratios)
        predicted, predicted_resident = predict(ours)
        records.append(FsdpOptionRecord(
            option=spec.name, description=spec.description, world_size=ctx.world_size,
            ours_step_times_s=ours_times, torch_step_times_s=torch_times,
            ours_median_s=statistics.median(ours_times), torch_median_s=statistics.median(torch_times),
            ratio_median=statistics.median(ratios), ratio_ci95=list(interval) if interval else None,
            ours_resident_bytes=ours_values[0], torch_resident_bytes=torch_values[0],
            ours_peak_bytes=ours_values[1], torch_peak_bytes=torch_values[1],
            ours_activation_peak_bytes=ours_values[2], torch_activation_peak_bytes=torch_values[2],
            ours_calls=dict(sorted(ours_acc.calls.items())), torch_calls=dict(sorted(torch_acc.calls.items())),
            ours_payload_bytes=dict(sorted(ours_acc.payload_bytes.items())),
            torch_payload_bytes=dict(sorted(torch_acc.payload_bytes.items())),
            predicted_payload_bytes=predicted, predicted_resident_bytes=predicted_resident,
        ))
    for side in sides.values():
        if side.side == OURS:
            side.model.release()
    return FsdpOptionsRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank,
                          n_parameters=sum(p.numel() for p in work.module.parameters()))


def run_fsdp_options_benchmark(setting: FsdpOptionsSetting) -> FsdpOptionsRun:
    """Run it: spawn the ranks here, or be one rank under torchrun/SLURM (every rank returns the
    same records)."""
    return run_setting(_benchmark_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
