"""The claims benchmark's rounds: every configuration fitted by a fresh Lightning Trainer, in turn.

Each round fits every configuration (configs.py) once, in an order rotated by one per round,
for ``warmup_steps + steps_per_round`` steps of the step benchmark's workload (the LM on a
fixed batch, bench/workload.py), and times the last ``steps_per_round``: each timed step starts
after a barrier and ends when the device is idle, and its time is the slowest rank's. A fresh
Trainer per fit is what a configuration change costs a user too (a new wrapper, its buckets
rebuilt after the first step), and rebuilding keeps only one configuration's buffers alive at a
time. Per round and configuration, the largest rank's peak device memory over the fit (CUDA).

The processes are ours (cs336_systems.launch: spawned here, or under torchrun/SLURM); Lightning
joins the process group they already hold, as it does under torchrun. ``sync_batchnorm`` is
probed apart (:func:`batchnorm_deviation`): its claim is about statistics, not time.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cs336_systems.bench.claims.configs import TORCH, ClaimsSetting, Config
from cs336_systems.bench.claims.record import ClaimsRecord
from cs336_systems.bench.script import BenchmarkRun
from cs336_systems.bench.step.setting import LEARNING_RATE
from cs336_systems.bench.workload import build_workload
from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.launch import RankContext, run_ranks, run_setting

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ClaimsRun(BenchmarkRun):
    n_parameters: int = 0
    batchnorm: dict[str, Any] | None = None  # batchnorm_deviation's figures, or {"error": why not}
    fit_per_process: bool = False  # every fit had processes of its own (run_fits_per_process)

    @property
    def notes(self) -> dict[str, Any]:
        return {"n_parameters": self.n_parameters, "batchnorm": self.batchnorm,
                "fit_per_process": self.fit_per_process}


def _quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")


def _strategy(config_or_impl: Config | str, ctx: RankContext, **extra: Any) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from cs336_systems.lightning import CS336DDPStrategy

    impl = config_or_impl if isinstance(config_or_impl, str) else config_or_impl.implementation
    kwargs = {} if isinstance(config_or_impl, str) else config_or_impl.kwargs
    # One entry per rank of this node: ranks may share one GPU (gloo), which Trainer(devices=n) refuses.
    devices = [ctx.device] * ctx.local_world_size
    common = dict(parallel_devices=devices, process_group_backend=ctx.backend, **kwargs, **extra)
    return DDPStrategy(**common) if impl == TORCH else CS336DDPStrategy(variant="bucketed", **common)


def _trainer(strategy: Any, ctx: RankContext, steps: int, precision: str = "32-true",
             callbacks: tuple = (), sync_batchnorm: bool = False) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="gpu" if ctx.device.type == "cuda" else "cpu", devices=1, num_nodes=1, strategy=strategy,
        max_steps=steps, precision=precision, sync_batchnorm=sync_batchnorm, callbacks=list(callbacks),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )


class _LM:
    """The workload's LM as a LightningModule (built on first use: Lightning is imported late)."""

    @staticmethod
    def build(module: nn.Module) -> Any:
        import lightning.pytorch as pl

        class LMModule(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.lm = module

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                tokens, targets = batch
                logits = self.lm(tokens)
                return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

            def configure_optimizers(self) -> Any:
                return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)

        return LMModule()


def _timer(ctx: RankContext, warmup: int, times: list[float], peaks: list[int]) -> Any:
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        """Times each step after the first ``warmup``: from a barrier to an idle device."""

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ctx.device)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sync_device(ctx.device)
            dist.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync_device(ctx.device)
            if batch_idx >= warmup:
                times.append(time.perf_counter() - self.start)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            if ctx.device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(ctx.device))

    return StepTimer()


def _fit_config(ctx: RankContext, setting: ClaimsSetting, config: Config, times: list[float], peaks: list[int]) -> int:
    """One fit of ``config``; appends its timed steps and peak; returns the parameter count. With
    a fresh process per fit, the weights are drawn on the device (a process start per fit is
    enough cost)."""
    work = build_workload(ctx, setting, init_on_device=setting.fit_per_process)
    steps = setting.warmup_steps + setting.steps_per_round
    data = TensorDataset(work.tokens.repeat(steps, 1), work.targets.repeat(steps, 1))
    loader = DataLoader(data, batch_size=work.tokens.shape[0])
    trainer = _trainer(_strategy(config, ctx), ctx, steps, config.precision,
                       callbacks=(_timer(ctx, setting.warmup_steps, times, peaks),))
    trainer.fit(_LM.build(work.module), loader)
    return sum(p.numel() for p in work.module.parameters())


def batchnorm_deviation(ctx: RankContext, steps: int) -> dict[str, float]:
    """How far each rank's BatchNorm running statistics end from one process's on the whole batch.

    A small classifier with BatchNorm is fitted by our strategy with ``sync_batchnorm`` off and
    on (each rank 8 rows of a 8 x world-size global batch per step, rows dealt round-robin), and,
    in this process alone, by a plain loop on the whole global batch. Returned: the largest
    absolute difference of running mean and running variance over ranks, each way.
    """
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    rows = 8 * ctx.world_size * steps
    x = torch.randn(rows, 8, generator=g) * 3 + 2
    y = torch.randint(0, 4, (rows,), generator=g)

    def classifier() -> nn.Sequential:
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    reference = classifier()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(steps):
        batch = slice(s * 8 * ctx.world_size, (s + 1) * 8 * ctx.world_size)
        optimizer.zero_grad()
        F.cross_entropy(reference(x[batch]), y[batch]).backward()
        optimizer.step()
    want = reference[1]

    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = classifier()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    mine = slice(ctx.rank, rows, ctx.world_size)  # each step's 8 rows of this rank, in order
    figures = {}
    for sync in (False, True):
        module = Classifier()
        loader = DataLoader(TensorDataset(x[mine].to(ctx.device), y[mine].to(ctx.device)), batch_size=8)
        _trainer(_strategy("cs336", ctx), ctx, steps, sync_batchnorm=sync).fit(module, loader)
        got = module.net[1]
        for stat in ("running_mean", "running_var"):
            diff = (getattr(got, stat).cpu() - getattr(want, stat)).abs().max().item()
            figures[f"{stat}_{'synced' if sync else 'local'}"] = max(slowest_rank([diff], small_tensor_device(
                ctx.device, ctx.backend)))
    return figures


def _claims_rank(ctx: RankContext, setting: ClaimsSetting) -> ClaimsRun:
    _quiet_lightning()
    ctx.share_cpu_threads()
    chosen = setting.chosen
    times: dict[str, list[float]] = {c.name: [] for c in chosen}
    peaks: dict[str, list[int]] = {c.name: [] for c in chosen}
    n_parameters = 0
    # First, so that a backend that cannot run it says so in seconds (its error is recorded, not raised:
    # the timing rounds do not depend on it).
    try:
        batchnorm: dict[str, Any] = batchnorm_deviation(ctx, setting.batchnorm_steps)
    except (RuntimeError, ValueError) as e:
        batchnorm = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    for r in range(setting.rounds):
        shift = r % len(chosen)
        for config in chosen[shift:] + chosen[:shift]:
            n_parameters = _fit_config(ctx, setting, config, times[config.name], peaks[config.name])
    small = small_tensor_device(ctx.device, ctx.backend)
    records = []
    for config in chosen:
        peak = [int(p) for p in slowest_rank(peaks[config.name], small)] if peaks[config.name] else None
        records.append(ClaimsRecord(config.name, config.implementation, config.kwargs, config.precision,
                                    slowest_rank(times[config.name], small), setting.steps_per_round, peak))
    return ClaimsRun(records=records, world_size=ctx.world_size, shared_gpu=ctx.shared_gpu, rank=ctx.rank,
                     n_parameters=n_parameters, batchnorm=batchnorm)


def _one_fit_rank(ctx: RankContext, setting: ClaimsSetting, config: Config) -> tuple[list[float], int | None, int]:
    """A process's only fit: its timed steps (the slowest rank's), its peak (the largest rank's;
    None without allocator statistics) and the parameter count."""
    _quiet_lightning()
    times: list[float] = []
    peaks: list[int] = []
    n_parameters = _fit_config(ctx, setting, config, times, peaks)
    small = small_tensor_device(ctx.device, ctx.backend)
    peak = int(slowest_rank(peaks, small)[0]) if peaks else None
    return slowest_rank(times, small), peak, n_parameters


def run_fits_per_process(setting: ClaimsSetting) -> ClaimsRun:
    """The rounds with every fit in ranks of its own, spawned here (``--fit-per-process``).

    ``torch.cuda.reset_peak_memory_stats`` resets the high-water mark to what is allocated now, so
    fits sharing a process report peaks that include whatever earlier fits left allocated (the
    caching allocator's blocks in use by leftovers, Lightning's references); a fresh process per fit
    starts from nothing. Costs a process start and an import of Lightning per fit.
    """
    setting.validate()
    chosen = setting.chosen
    times: dict[str, list[float]] = {c.name: [] for c in chosen}
    peaks: dict[str, list[int]] = {c.name: [] for c in chosen}
    n_parameters = 0
    for r in range(setting.rounds):
        shift = r % len(chosen)
        for config in chosen[shift:] + chosen[:shift]:
            fit_times, peak, n_parameters = run_ranks(
                _one_fit_rank, setting.world_size, args=(setting, config), backend=setting.backend,
                device_type=setting.device, timeout_s=RANK_TIMEOUT_S, join_timeout_s=RUN_TIMEOUT_S)[0]
            times[config.name] += fit_times
            if peak is not None:
                peaks[config.name].append(peak)
    records = [ClaimsRecord(c.name, c.implementation, c.kwargs, c.precision, times[c.name], setting.steps_per_round,
                            peaks[c.name] or None) for c in chosen]
    return ClaimsRun(records=records, world_size=setting.world_size,
                     shared_gpu=setting.device == "cuda" and setting.world_size > 1 and setting.backend_name == "gloo",
                     rank=0, n_parameters=n_parameters, batchnorm=None, fit_per_process=True)


def run_claims_benchmark(setting: ClaimsSetting) -> ClaimsRun:
    """Spawn the ranks here, or be one rank under torchrun/SLURM; every rank returns the same figures."""
    if setting.fit_per_process:
        return run_fits_per_process(setting)
    return run_setting(_claims_rank, setting, RANK_TIMEOUT_S, RUN_TIMEOUT_S)
