"""Optimizer state sharding, accounted for: what ZeRO stage 1 saves in memory and costs in time.

For the Transformer LM at one size we train a few data-parallel steps twice, once per
*configuration*:

* ``unsharded``: ``torch.optim.AdamW`` on every rank, each holding the whole optimizer state;
* ``sharded``: :class:`~cs336_systems.sharded_optimizer.ShardedOptimizer` over AdamW, each
  rank holding the state of the parameters it owns and broadcasting them after its update.

Both synchronise gradients with :class:`~cs336_systems.ddp.NaiveDDP`, which all-reduces
each ``.grad`` in place and so holds no gradient copy (a flat or bucketed wrapper keeps its
buffers, which would blur the breakdown); the two configurations differ only in the optimizer.

Memory is read at three points: after model initialisation (model, DDP wrapper and optimizer
built), directly before ``optimizer.step()`` (forward, backward, gradient all-reduce done) and
directly after it; at each we record the peak since the previous point and the current level.
The breakdown counts bytes exactly, storage by storage: parameters, gradients, and the optimizer
state this rank holds; what the peak holds beyond them ("other": activations, temporaries,
communication buffers, allocator slack) is the difference.

How memory is measured (each record's ``method``):

* ``cuda_allocator``: ``torch.cuda.max_memory_allocated`` / ``memory_allocated``, the peak reset
  with ``reset_peak_memory_stats`` at every point: tensor bytes only, exact.
* ``rss``: on a CPU torch keeps no allocator statistics (``tracemalloc`` sees only Python's own
  allocations, not torch's C++ ones), so we read the process's resident set size from
  ``/proc/self/status``: VmRSS now, VmHWM the peak. Since Linux 4.0 writing ``5`` to
  ``/proc/self/clear_refs`` resets VmHWM to the current RSS (proc(5)), which gives per-phase
  peaks as on the GPU; ``peak_resettable`` says whether that worked. RSS counts pages, not
  tensors, so three things are done to make it follow tensor memory. (1) Levels are reported
  above a per-configuration ``baseline_bytes`` taken before the model is built: RSS includes the
  interpreter and libraries. (2) Before the baseline, one untimed training step of a throwaway
  model of the same configuration runs, because the first use of torch's kernels pages in code
  and allocates runtime buffers (about 160 MiB here, once per process). (3) glibc normally
  keeps freed blocks for reuse: it raises its mmap threshold each time a mapped block is freed
  (up to 32 MiB on 64-bit, mallopt(3)), after which freed tensors stay resident and RSS stops
  falling when tensors are freed. Fixing the threshold with ``mallopt`` (which turns off that
  adjustment) makes every block of 128 KiB or more its own mapping, returned to the OS when
  freed; ``malloc_mmap_threshold_bytes`` records it (None where it could not be set). Even so,
  when this module spawns the ranks each configuration gets its own launch, fresh processes
  (``fresh_process``), so that no configuration inherits another's heap.

Expected values, from the ShardedOptimizer docstring: fp32 AdamW keeps two moments per
parameter, 8P bytes for P parameters (2B, B = parameter bytes) unsharded and about 8P/n per rank
on n ranks, a rank's excess over the average bounded by the moments of the largest parameter;
AdamW adds a scalar ``step`` tensor per parameter. Communication per rank per step: DDP's ring
all-reduce 2(n-1)/n * B; this repo's sharded optimizer adds parameter broadcasts, (n-1)/n * B;
the paper's ZeRO-1 (reduce-scatter the gradients, all-gather the parameters) moves 2(n-1)/n * B
in all, DDP's volume (Rajbhandari et al., 2020, Sec. 7.2.1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.model import TransformerLM, model_config
from cs336_systems.ddp import NaiveDDP
from cs336_systems.launch import RankContext, run_ranks, running_under_launcher
from cs336_systems.sharded_optimizer import ShardedOptimizer

CONFIGURATIONS = ("unsharded", "sharded")
PHASES = ("after_init", "before_step", "after_step")
_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default starting threshold, held fixed


@dataclass(frozen=True)
class ShardingAccountingSetting:
    """What one accounting run measures."""

    model_size: str = "cpu-small"  # key of model.MODEL_SIZES
    context_length: int = 128  # tokens per sequence
    batch_per_rank: int = 2  # sequences per rank per step
    world_size: int = 2  # ranks
    device_type: str = "cpu"  # "cpu" or "cuda"
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    steps: int = 3  # timed steps per configuration; memory phases are read on the last
    warmup_steps: int = 1  # untimed steps first (the first step allocates AdamW's state)
    bucket_size_mb: float = 32.0  # ShardedOptimizer's broadcast bucket cap
    lr: float = 1e-4  # AdamW learning rate (other hyperparameters at torch's defaults)
    seed: int = 0  # model weights and data
    configurations: tuple[str, ...] = CONFIGURATIONS  # measured in this order

    def __post_init__(self) -> None:
        model_config(self.model_size, self.context_length)  # ValueError for unknown sizes
        for name in ("batch_per_rank", "world_size", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        unknown = [c for c in self.configurations if c not in CONFIGURATIONS]
        if unknown or not self.configurations:
            raise ValueError(
                f"configurations must be a non-empty selection of {CONFIGURATIONS}, "
                f"got {self.configurations!r}"
            )


# Pure accounting ------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once.

    Storages, not tensor sizes: a view (a gradient inside a bucket, say) is only a window on
    memory that something else holds, and two views of one storage hold it once.
    """
    held: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            held[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(held.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (for a ShardedOptimizer: this rank's shard)."""
    return storage_bytes(
        value
        for per_parameter in optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    )


def expected_adam_state_bytes(parameter_bytes: int, world_size: int, sharded: bool) -> float:
    """AdamW's two moments per rank by the ShardedOptimizer docstring's formula: 2B, or 2B / n.

    For fp32 parameters (B = 4P) that is 8P unsharded and 8P/n sharded. Leaves out the scalar
    ``step`` tensors and the imbalance of the shards, both visible in the measured figure.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * parameter_bytes / (world_size if sharded else 1)


def communication_bytes_per_rank(parameter_bytes: int, world_size: int) -> dict[str, float]:
    """Bytes each rank sends (and receives) per training step, by the standard cost formulas.

    Ring all-reduce: 2(n-1)/n * B (reduce-scatter then all-gather, nccl-tests' busbw factor);
    the sharded optimizer's broadcasts: every rank receives the (n-1)/n * B it does not own,
    the volume of an all-gather; paper ZeRO-1: reduce-scatter + all-gather, 2(n-1)/n * B.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    share = (world_size - 1) / world_size * parameter_bytes
    return {
        "parameter_bytes": parameter_bytes,
        "ddp_allreduce": 2 * share,
        "sharded_optimizer_broadcast": share,
        "ddp_plus_sharded_optimizer": 3 * share,
        "paper_zero1": 2 * share,
    }


# Measuring memory -------------------------------------------------------------------------------


def read_proc_status(text: str) -> dict[str, int]:
    """VmRSS and VmHWM, in bytes, from the text of /proc/<pid>/status (which gives kB = KiB)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = rest.split()
            if unit != "kB":
                raise ValueError(f"unexpected unit {unit!r} for {key} in /proc status")
            values[key] = int(number) * 1024
    return values


def fix_malloc_mmap_threshold(threshold_bytes: int = MALLOC_MMAP_THRESHOLD_BYTES) -> int | None:
    """Make glibc map blocks of ``threshold_bytes`` or more on their own and unmap them on free.

    Returns the threshold, or None where there is no glibc ``mallopt`` (musl, macOS) or it
    refused. Also sets the trim threshold, so freed memory at the top of the heap goes back too.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    # mallopt returns 1 on success, 0 on error.
    if mallopt(_M_MMAP_THRESHOLD, threshold_bytes) != 1 or mallopt(_M_TRIM_THRESHOLD, threshold_bytes) != 1:
        return None
    return threshold_bytes


class RssMeter:
    """The process's resident set size: VmRSS and its high-water mark VmHWM (Linux)."""

    method = "rss"

    def __init__(self) -> None:
        self.peak_resettable = self._try_reset()

    def _try_reset(self) -> bool:
        try:
            with open(_PROC_CLEAR_REFS, "w") as f:
                f.write("5")  # proc(5), clear_refs: 5 sets VmHWM to the current RSS (Linux >= 4.0)
            return True
        except OSError:
            return False

    def reset_peak(self) -> None:
        if self.peak_resettable:
            self._try_reset()

    def read(self) -> tuple[int, int | None]:
        """(peak bytes, current bytes); without /proc, the lifetime peak and no current level."""
        try:
            with open(_PROC_STATUS) as f:
                values = read_proc_status(f.read())
            return values["VmHWM"], values["VmRSS"]
        except OSError:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak * (1 if sys.platform == "darwin" else 1024), None  # bytes on macOS, KiB on Linux


class CudaAllocatorMeter:
    """torch's CUDA caching allocator statistics: bytes of live tensors, exactly."""

    method = "cuda_allocator"
    peak_resettable = True

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> tuple[int, int | None]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)


# One configuration on one rank ---------------------------------------------------------------


def _snapshot(
    meter: RssMeter | CudaAllocatorMeter, baseline: int, module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    peak, current = meter.read()
    params = list(module.parameters())
    breakdown = {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params),
        "optimizer_state": optimizer_state_bytes(optimizer),
    }
    peak_above = peak - baseline
    breakdown["other"] = peak_above - sum(breakdown.values())
    return {
        "peak_bytes": peak,
        "current_bytes": current,
        "peak_above_baseline_bytes": peak_above,
        "current_above_baseline_bytes": None if current is None else current - baseline,
        "breakdown": breakdown,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Per-step maximum over ranks: a step ends when its slowest rank does."""
    local = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def _build(
    ctx: RankContext, setting: ShardingAccountingSetting, configuration: str
) -> tuple[nn.Module, NaiveDDP, torch.optim.Optimizer, list[nn.Parameter]]:
    """(module, its DDP wrapper, the optimizer, the parameters whose state this rank keeps)."""
    torch.manual_seed(setting.seed)
    module = TransformerLM(model_config(setting.model_size, setting.context_length)).to(ctx.device)
    model = NaiveDDP(module)
    params = list(module.parameters())
    if configuration == "sharded":
        optimizer: torch.optim.Optimizer = ShardedOptimizer(
            params, torch.optim.AdamW, bucket_size_mb=setting.bucket_size_mb, lr=setting.lr
        )
        owned = [params[i] for i in optimizer.owned_indices(ctx.rank)]
    else:
        optimizer = torch.optim.AdamW(params, lr=setting.lr)
        owned = params
    return module, model, optimizer, owned


def _forward_backward(model: NaiveDDP, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    del logits  # dead after backward: keep it out of the level read before the step
    model.finish_gradient_synchronization()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure_configuration(
    ctx: RankContext,
    setting: ShardingAccountingSetting,
    configuration: str,
    fresh_process: bool,
    malloc_threshold: int | None,
) -> dict:
    meter = CudaAllocatorMeter(ctx.device) if ctx.device.type == "cuda" else RssMeter()
    config = model_config(setting.model_size, setting.context_length)
    g = torch.Generator().manual_seed(setting.seed * 1_000_003 + ctx.rank)
    data = torch.randint(0, config.vocab_size, (setting.batch_per_rank, config.context_length + 1), generator=g)
    tokens, targets = data[:, :-1].to(ctx.device), data[:, 1:].to(ctx.device)

    # Throwaway step: pays the first use of every kernel and collective before the baseline.
    _, model, optimizer, _ = _build(ctx, setting, configuration)
    _forward_backward(model, tokens, targets)
    optimizer.step()
    del model, optimizer
    _free(ctx.device)
    _sync(ctx.device)
    dist.barrier()

    meter.reset_peak()
    baseline = meter.read()[1] or 0
    module, model, optimizer, owned = _build(ctx, setting, configuration)
    phases = {"after_init": _snapshot(meter, baseline, module, optimizer)}

    first_step_phases: dict = {}
    step_times, optimizer_times = [], []
    for step in range(setting.warmup_steps + setting.steps):
        _sync(ctx.device)
        dist.barrier()
        meter.reset_peak()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _forward_backward(model, tokens, targets)
        _sync(ctx.device)
        backward_done = time.perf_counter()
        before = _snapshot(meter, baseline, module, optimizer)
        meter.reset_peak()
        step_start = time.perf_counter()
        optimizer.step()
        _sync(ctx.device)
        step_done = time.perf_counter()
        after = _snapshot(meter, baseline, module, optimizer)
        if step == 0:
            first_step_phases = {"before_step": before, "after_step": after}
        if step >= setting.warmup_steps:
            step_times.append((backward_done - start) + (step_done - step_start))
            optimizer_times.append(step_done - step_start)
    phases.update(before_step=before, after_step=after)

    params = list(module.parameters())
    parameter_bytes = storage_bytes(params)
    largest = max(storage_bytes([p]) for p in params)
    sharded = configuration == "sharded"
    comm = communication_bytes_per_rank(parameter_bytes, ctx.world_size)
    step_times = _slowest_rank(step_times, ctx.device)
    optimizer_times = _slowest_rank(optimizer_times, ctx.device)
    record = {
        "configuration": configuration,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "method": meter.method,
        "peak_resettable": meter.peak_resettable,
        "fresh_process": fresh_process,
        "malloc_mmap_threshold_bytes": malloc_threshold,
        "baseline_bytes": baseline,
        "phases": phases,
        "first_step_phases": first_step_phases,
        "n_parameters": sum(p.numel() for p in params),
        "n_parameter_tensors": len(params),
        "parameter_bytes": parameter_bytes,
        "largest_parameter_bytes": largest,
        "owned_parameters": len(owned),
        "owned_parameter_bytes": storage_bytes(owned),
        "measured_optimizer_state_bytes": phases["after_step"]["breakdown"]["optimizer_state"],
        "expected_optimizer_state_bytes": expected_adam_state_bytes(parameter_bytes, ctx.world_size, sharded),
        # A shard exceeds B/n by at most the largest parameter (assign_to_ranks), its moments 2x.
        "expected_optimizer_state_imbalance_bound_bytes": 2 * largest if sharded else 0,
        "communication_bytes_per_rank": {
            "gradient_allreduce": comm["ddp_allreduce"],
            "parameter_broadcast": comm["sharded_optimizer_broadcast"] if sharded else 0.0,
            # Exactly what this rank receives: every parameter it does not own.
            "parameter_broadcast_received": float(parameter_bytes - storage_bytes(owned)) if sharded else 0.0,
        },
        "step_times_s": step_times,
        "optimizer_step_times_s": optimizer_times,
        "median_step_s": statistics.median(step_times),
        "median_optimizer_step_s": statistics.median(optimizer_times),
    }
    del model, module, optimizer, owned, params
    _free(ctx.device)
    return record


def _accounting_rank(
    ctx: RankContext, setting: ShardingAccountingSetting, configurations: tuple[str, ...]
) -> list[dict]:
    """Every rank's records for ``configurations``, measured in order (on every rank alike)."""
    ctx.share_cpu_threads()
    # Only RSS needs freed memory handed back; the CUDA allocator counts live tensors itself.
    malloc_threshold = fix_malloc_mmap_threshold() if ctx.device.type == "cpu" else None
    records = []
    for i, configuration in enumerate(configurations):
        mine = _measure_configuration(ctx, setting, configuration, i == 0, malloc_threshold)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        records.extend(gathered)
    return records


def run_sharding_accounting(setting: ShardingAccountingSetting) -> list[dict]:
    """One record per (configuration, rank), configurations in ``setting`` order, ranks ascending.

    Spawning the ranks here, each configuration gets its own launch, so that its process
    memory starts clean; under torchrun this process is one rank of one job and measures the
    configurations one after the other (``fresh_process`` False after the first).
    """
    launch_kwargs = dict(
        backend=setting.backend, device_type=setting.device_type, timeout_s=600, join_timeout_s=3600
    )
    if running_under_launcher():
        return run_ranks(_accounting_rank, setting.world_size, (setting, setting.configurations), **launch_kwargs)[0]
    records = []
    for configuration in setting.configurations:
        results = run_ranks(_accounting_rank, setting.world_size, (setting, (configuration,)), **launch_kwargs)
        records.extend(results[0])
    return records


def setting_record(setting: ShardingAccountingSetting) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setting).items()}
