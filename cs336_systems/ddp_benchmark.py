"""The DDP step benchmark (problems 3, 4, 5a, 6a): every variant's training step, side by side.

One process group times full training steps of the Transformer LM (forward, backward,
gradient synchronisation, AdamW step) for each variant:

* ``compute-only``: the bare module, no communication: the floor no DDP can beat;
* ``naive``, ``flat``, ``per-parameter``, ``bucketed-<N>MB``: this repo's wrappers;
* ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` at its defaults.

All variants wrap the *same* module and optimizer, are built once and warmed up once (as a
training job builds its wrapper once; with ``rebuild_each_round``, for models whose gradient
buffers fit in memory only a few times over, our wrappers are instead built, warmed up and
dropped within each round), and run interleaved round by round (round r: a
few steps of each variant in turn, the order rotated by one variant each round so that no
variant always follows the same one), so that drift of a noisy machine (thermal, other
tenants) hits all alike. Each step starts after a barrier; its time is the slowest
rank's. Per variant we report the median step time, the time inside gradient
synchronisation (naive/flat: the all-reduce phase after backward; overlapped variants: the
wait in ``finish_gradient_synchronization``; torch DDP does it inside backward, so none),
the exposed overhead (median over rounds of the step minus the compute-only step of the same
round, with a 95% interval: see paired_stats.py), its share of the step, tokens per second,
and all-reduce calls per step.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_systems.ddp import BucketedDDP, DataParallel, FlatDDP, NaiveDDP, PerParameterDDP
from cs336_systems.equivalence import shard_rows
from cs336_systems.model import TransformerLM, model_config
from cs336_systems.bench.stats import paired_median
from cs336_systems.launch import RankContext, run_ranks

COMPUTE_ONLY = "compute-only"
TORCH_DDP = "torch-ddp"


@dataclass(frozen=True)
class StepBenchmarkSetting:
    """What one benchmark run measures."""

    model_size: str = "cpu-small"  # key of model.MODEL_SIZES
    context_length: int = 128  # tokens per sequence
    global_batch: int = 4  # sequences per step over all ranks
    world_size: int = 2  # ranks
    device_type: str = "cpu"  # "cpu" or "cuda"
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    bucket_sizes_mb: tuple[float, ...] = (1, 10, 100, 1000)  # one bucketed variant each
    include_torch_ddp: bool = True  # time torch's DDP in the same run
    variants: tuple[str, ...] | None = None  # explicit variant list (see parse); None: the sweep
    rounds: int = 3  # interleaved rounds
    steps_per_round: int = 3  # timed steps of each variant per round
    warmup_steps: int = 1  # untimed steps of each variant before it is first timed
    rebuild_each_round: bool = False  # keep one of our wrappers (and its buffers) alive at a time
    seed: int = 0

    def variant_names(self) -> list[str]:
        if self.variants is not None:
            return list(self.variants)
        names = [COMPUTE_ONLY, "naive", "flat", "per-parameter"]
        names += [bucketed_name(mb) for mb in self.bucket_sizes_mb]
        if self.include_torch_ddp:
            names.append(TORCH_DDP)
        return names


def bucketed_name(bucket_size_mb: float) -> str:
    return f"bucketed-{bucket_size_mb:g}MB"


# Suffixes of a bucketed variant's name that switch one lever of BucketedDDP off (or bf16 on).
LEVER_SUFFIXES = {
    "-copy": {"gradient_as_bucket_view": False},
    "-no-first": {"first_bucket_mb": None},
    "-no-reorder": {"reorder_after_first_step": False},
    "-plain": {"gradient_as_bucket_view": False, "first_bucket_mb": None, "reorder_after_first_step": False},
    "-bf16": {"comm_dtype": torch.bfloat16},
}
# The ablation: every lever on, each one off, all off, bf16 communication; torch DDP beside.
ABLATION_VARIANTS = (
    COMPUTE_ONLY,
    "per-parameter",
    "bucketed-25MB-plain",
    "bucketed-25MB-copy",
    "bucketed-25MB-no-first",
    "bucketed-25MB-no-reorder",
    "bucketed-25MB",
    "bucketed-25MB-bf16",
    "bucketed-auto",
    TORCH_DDP,
)


def parse_bucketed(name: str) -> tuple[float | str, dict]:
    """``bucketed-<N>MB[<suffix>]`` -> (bucket size in MB, BucketedDDP keyword arguments);
    ``bucketed-auto`` -> ("auto", {})."""
    rest = name.removeprefix("bucketed-")
    if rest == "auto":
        return "auto", {}
    options: dict = {}
    for suffix, lever in LEVER_SUFFIXES.items():
        if rest.endswith(suffix):
            rest = rest.removesuffix(suffix)
            options.update(lever)
    if not rest.endswith("MB"):
        raise ValueError(f"unknown variant {name!r}: expected bucketed-<N>MB[{'|'.join(LEVER_SUFFIXES)}]")
    try:
        return float(rest.removesuffix("MB")), options
    except ValueError as e:
        raise ValueError(f"unknown variant {name!r}: bad bucket size") from e


def check_variant_name(name: str) -> None:
    if name in (COMPUTE_ONLY, TORCH_DDP, "naive", "flat", "per-parameter"):
        return
    if not name.startswith("bucketed-"):
        raise ValueError(f"unknown variant {name!r}")
    parse_bucketed(name)


@dataclass
class _Variant:
    """A variant as run: what forward is called on, and its synchronisation step."""

    name: str
    model: nn.Module
    wrapper: DataParallel | None = None  # our wrappers; None for compute-only and torch DDP

    @property
    def finish(self) -> Callable[[], None] | None:
        return self.wrapper.finish_gradient_synchronization if self.wrapper is not None else None


@dataclass
class _Measurements:
    """Everything one rank measured for one variant, over all rounds."""

    step_times: list[float] = field(default_factory=list)
    sync_times: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    n_buckets: int | None = None
    bucket_cap_bytes: float | None = None  # what "auto" chose, for bucketed variants


def _sync_stream(device: torch.device) -> None:
    # Only the compute stream: NCCL runs on its own streams, and waiting for those here would
    # hide how much communication is still outstanding when backward ends.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_variant(name: str, module: nn.Module, setting: StepBenchmarkSetting, ctx: RankContext) -> _Variant:
    if name == COMPUTE_ONLY:
        return _Variant(name, module)
    if name == TORCH_DDP:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return _Variant(name, DistributedDataParallel(module, device_ids=device_ids))
    if name == "naive":
        wrapper: DataParallel = NaiveDDP(module)
    elif name == "flat":
        wrapper = FlatDDP(module)
    elif name == "per-parameter":
        wrapper = PerParameterDDP(module)
    else:
        mb, options = parse_bucketed(name)
        wrapper = BucketedDDP(module, bucket_size_mb=mb, **options)
    return _Variant(name, wrapper, wrapper)


def _timed_step(
    variant: _Variant,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
) -> tuple[float, float]:
    """One training step; returns (step seconds, seconds in gradient synchronisation)."""
    _sync_device(device)
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = variant.model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    _sync_stream(device)
    backward_done = time.perf_counter()
    if variant.finish is not None:
        variant.finish()
        _sync_stream(device)
    sync_done = time.perf_counter()
    optimizer.step()
    _sync_device(device)
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


def _retire(name: str, variant: _Variant, m: _Measurements) -> None:
    """Record a variant's bucket layout, then detach it from the shared module."""
    if isinstance(variant.wrapper, BucketedDDP):
        m.n_buckets = len(variant.wrapper.buckets)
        cap = variant.wrapper.bucket_cap_bytes
        m.bucket_cap_bytes = cap if math.isfinite(cap) else None
    if name == TORCH_DDP:
        m.n_buckets = _torch_ddp_bucket_count(variant.model)
        if m.n_buckets is not None:
            m.calls.append(m.n_buckets)
    if variant.wrapper is not None:
        variant.wrapper.detach()


def _slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Per-step maximum over ranks (a step ends when its slowest rank does)."""
    local = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def _benchmark_rank(ctx: RankContext, setting: StepBenchmarkSetting) -> dict:
    ctx.share_cpu_threads()
    torch.manual_seed(setting.seed)
    config = model_config(setting.model_size, setting.context_length)
    module = TransformerLM(config).to(ctx.device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    rows = shard_rows(setting.global_batch, ctx.rank, ctx.world_size)
    g = torch.Generator().manual_seed(setting.seed)
    data = torch.randint(0, config.vocab_size, (setting.global_batch, config.context_length + 1), generator=g)
    tokens = data[rows, :-1].to(ctx.device)
    targets = data[rows, 1:].to(ctx.device)

    names = setting.variant_names()
    measured = {name: _Measurements() for name in names}
    # Wrappers stay attached to the shared module for the whole run: each one's hooks act only
    # on backward passes of its own forward (ddp/overlap.py), and torch's reducer ignores
    # backward passes it did not start, so the wrappers do not see each other's steps. Torch's
    # DDP is always built once: rebuilding it would re-register its hooks on the module.
    def build(name: str) -> _Variant:
        variant = _make_variant(name, module, setting, ctx)
        for _ in range(setting.warmup_steps):
            _timed_step(variant, optimizer, tokens, targets, ctx.device)
        return variant

    rebuilt = {n for n in names if setting.rebuild_each_round and n != TORCH_DDP}
    kept = {name: build(name) for name in names if name not in rebuilt}
    for r in range(setting.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            variant, m = kept[name] if name in kept else build(name), measured[name]
            for _ in range(setting.steps_per_round):
                step_s, sync_s = _timed_step(variant, optimizer, tokens, targets, ctx.device)
                m.step_times.append(step_s)
                m.sync_times.append(sync_s)
                if variant.wrapper is not None:
                    m.calls.append(variant.wrapper.allreduce_calls_last_step)
            if name in rebuilt:
                _retire(name, variant, m)
    for name, variant in kept.items():
        _retire(name, variant, measured[name])
    records = []
    for name in names:
        m = measured[name]
        has_sync_phase = name not in (COMPUTE_ONLY, TORCH_DDP)  # same on every rank
        records.append(
            {
                "variant": name,
                "step_times_s": _slowest_rank(m.step_times, ctx.device),
                "sync_times_s": _slowest_rank(m.sync_times, ctx.device) if has_sync_phase else None,
                "allreduce_calls_per_step": statistics.median(m.calls) if m.calls else None,
                "n_buckets": m.n_buckets,
                "bucket_cap_bytes": m.bucket_cap_bytes,
            }
        )
    return {"records": records, "n_parameters": sum(p.numel() for p in module.parameters())}


def summarize(raw_records: list[dict], setting: StepBenchmarkSetting) -> list[dict]:
    """Medians, spreads and the derived figures, one record per variant.

    The exposed overhead is paired round by round with the compute-only step (see
    paired_stats.py): step ``i`` of every variant ran in the same round.
    """
    floor_times = next(r for r in raw_records if r["variant"] == COMPUTE_ONLY)["step_times_s"]
    tokens_per_step = setting.global_batch * setting.context_length
    out = []
    for raw in raw_records:
        steps = sorted(raw["step_times_s"])
        median_step = statistics.median(steps)
        syncs = raw["sync_times_s"]
        exposed, interval = paired_median(raw["step_times_s"], floor_times)
        out.append(
            {
                **raw,
                "bucket_size_mb": (
                    parse_bucketed(raw["variant"])[0] if raw["variant"].startswith("bucketed-") else None
                ),
                "median_step_s": median_step,
                "min_step_s": steps[0],
                "max_step_s": steps[-1],
                "median_sync_s": statistics.median(syncs) if syncs else None,
                "exposed_overhead_s": exposed,
                "exposed_overhead_ci95_s": list(interval) if interval else None,
                "exposed_share": exposed / median_step,
                "tokens_per_s": tokens_per_step / median_step,
                "steps_timed": len(steps),
            }
        )
    return out


def run_step_benchmark(setting: StepBenchmarkSetting) -> tuple[list[dict], int]:
    """Run the benchmark (spawning ranks, or as one rank under torchrun).

    Returns (one summarised record per variant, number of model parameters).
    """
    shard_rows(setting.global_batch, 0, setting.world_size)  # ValueErrors before spawning
    for name in setting.variant_names():
        check_variant_name(name)
    if COMPUTE_ONLY not in setting.variant_names():
        raise ValueError(f"variants must include {COMPUTE_ONLY!r}: exposed overhead is measured against it")
    model_config(setting.model_size, setting.context_length)  # ValueError for unknown sizes
    results = run_ranks(
        _benchmark_rank,
        setting.world_size,
        args=(setting,),
        backend=setting.backend,
        device_type=setting.device_type,
        timeout_s=600,
        join_timeout_s=3600,
    )
    first = results[0]
    return summarize(first["records"], setting), first["n_parameters"]


def setting_record(setting: StepBenchmarkSetting) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setting).items()}
