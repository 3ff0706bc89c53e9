"""Rank functions of the in-job doctor's tests: small training jobs, healthy or with one planted
fault, in a plain PyTorch loop and in a Lightning Trainer, each with the doctor added by its three
lines. Every job runs a fixed number of steps on every rank, so a fault never hangs the run.

Faults, each on rank 1 only:

* ``no-sampler``: its DataLoader has no DistributedSampler (rank 0's has one);
* ``skips-steps``: it skips ``optimizer.step()`` at the second batch (a rank-local check), while
  its forward and backward still run, so the collectives stay paired;
* ``diverges``: it changes its own weights in its first step, before the optimizer's;
* ``straggler`` (plain loop only): its forward sleeps ``STRAGGLER_DELAY_S`` every step;
* ``slow-loader`` (plain): its DataLoader sleeps ``STRAGGLER_DELAY_S`` per batch;
* ``uneven-samples`` (plain): its batches hold 8 rows where rank 0's hold 4 (as many batches);
* ``fsdp2-healthy`` (plain): our ``fully_shard``, every parameter a shard only its rank holds;
* ``fsdp2-diverges`` (plain): torch's ``fully_shard`` over a (replicate 2, shard 1) mesh (HSDP:
  each rank a replica of the other's shards), and it changes its shard in its first step.

:func:`skips_iteration_job` runs apart, as it fails: rank 1 skips one iteration, so rank 0 is
still in that iteration's all-reduce when rank 1 reaches ``report()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

from cs336_systems.launch import RankContext

STEPS = 3
ROWS, FEATURES, CLASSES, BATCH = 32, 6, 3, 4
HEALTHY, NO_SAMPLER, SKIPS_STEPS, DIVERGES, STRAGGLER = "healthy", "no-sampler", "skips-steps", "diverges", "straggler"
SLOW_LOADER, UNEVEN_SAMPLES = "slow-loader", "uneven-samples"
FSDP2_HEALTHY, FSDP2_DIVERGES = "fsdp2-healthy", "fsdp2-diverges"
PLAIN_JOBS = (HEALTHY, NO_SAMPLER, SKIPS_STEPS, DIVERGES, STRAGGLER, SLOW_LOADER, UNEVEN_SAMPLES, FSDP2_HEALTHY,
              FSDP2_DIVERGES)
REPORT_TIMEOUT_S = 5.0  # the skipping job's: far above a healthy report's wait here (milliseconds)
LIGHTNING_JOBS = (HEALTHY, NO_SAMPLER, SKIPS_STEPS, DIVERGES)
FAULTY = 1
STRAGGLER_DELAY_S = 0.6
# A straggler is 0.3 s slower than the others at its fastest step: far above the noise of a
# loaded 2-core machine, far below the planted delay.
OPTIONS = {"straggler_min_excess_s": 0.3}


class Net(nn.Module):
    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.layers(x)


def _data(rows: int = ROWS) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(rows, FEATURES, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))


def _slow_collate(rows: list) -> Any:
    time.sleep(STRAGGLER_DELAY_S)
    return default_collate(rows)


def _loader(ctx: RankContext, fault: str) -> DataLoader:
    faulty = ctx.rank == FAULTY
    if fault == UNEVEN_SAMPLES and faulty:  # twice the rows per batch, as many batches
        data = _data(2 * ROWS)
        return DataLoader(data, batch_size=2 * BATCH, sampler=DistributedSampler(data, shuffle=False))
    data = _data()
    if fault == NO_SAMPLER and faulty:
        return DataLoader(data, batch_size=BATCH)
    collate = _slow_collate if fault == SLOW_LOADER and faulty else None
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False), collate_fn=collate)


def _model(ctx: RankContext, fault: str) -> nn.Module:
    """The job's model: our bucketed DDP, or sharded as FSDP2 (ours, or torch's over HSDP's mesh)."""
    net = Net(STRAGGLER_DELAY_S if fault == STRAGGLER and ctx.rank == FAULTY else 0.0)
    if fault == FSDP2_HEALTHY:
        from cs336_systems.fsdp import fully_shard

        return fully_shard(net)
    if fault == FSDP2_DIVERGES:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
        return torch_fully_shard(net, mesh=mesh)
    from cs336_systems.ddp import BucketedDDP

    return BucketedDDP(net)


def _perturb(module: nn.Module) -> None:
    with torch.no_grad():
        first = next(module.parameters())
        (first.to_local() if hasattr(first, "to_local") else first).add_(1e-3)


def plain_job(ctx: RankContext, fault: str) -> list[str]:
    """A plain loop with our bucketed DDP (or FSDP2); the doctor's three lines marked."""
    from cs336_systems.doctor import JobDoctor  # line 1

    model = _model(ctx, fault)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(ctx, fault)
    doctor = JobDoctor(model, optimizer, loader, **OPTIONS)  # line 2
    for step, (x, y) in zip(range(STEPS), loader):
        F.cross_entropy(model(x), y).backward()
        if fault in (DIVERGES, FSDP2_DIVERGES) and ctx.rank == FAULTY and step == 0:
            _perturb(model)
        if not (fault == SKIPS_STEPS and ctx.rank == FAULTY and step == 1):
            optimizer.step()
        optimizer.zero_grad()
    return doctor.report(print_findings=False)  # line 3


def lightning_job(ctx: RankContext, fault: str) -> list[str]:
    """A Lightning fit with CS336DDPStrategy; the doctor is one callback."""
    import lightning.pytorch as pl

    from cs336_systems.doctor.callback import DoctorCallback
    from cs336_systems.lightning import CS336DDPStrategy

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if fault == SKIPS_STEPS and self.global_rank == FAULTY and batch_idx == 1:
                optimizer_closure()  # forward and backward (their collectives) run; no step
                return
            optimizer.step(closure=optimizer_closure)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if fault == DIVERGES and self.global_rank == FAULTY and self.global_step == 0:
                _perturb(self.net)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    doctor = DoctorCallback(**OPTIONS)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CS336DDPStrategy(process_group_backend="gloo"),
                         max_steps=STEPS, callbacks=[doctor], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=fault != NO_SAMPLER)
    # Lightning puts a DistributedSampler in the loader unless told not to; with no_sampler, the
    # loaders stay as built: rank 1's without one.
    loader = _loader(ctx, fault) if fault == NO_SAMPLER else DataLoader(_data(), batch_size=BATCH)
    trainer.fit(Classifier(), loader)
    return doctor.findings


def run_doctor_jobs(ctx: RankContext) -> dict[str, list[str]]:
    """Rank function: every job, plain then Lightning; the findings of each."""
    from tests.lightning_cases import quiet_lightning

    quiet_lightning()
    torch.set_num_threads(1)
    found = {f"plain-{fault}": plain_job(ctx, fault) for fault in PLAIN_JOBS}
    found.update({f"lightning-{fault}": lightning_job(ctx, fault) for fault in LIGHTNING_JOBS})
    return found


def skips_iteration_job(ctx: RankContext) -> list[str]:
    """Rank 1 skips its second iteration: rank 0's third waits in an all-reduce rank 1 never joins,
    while rank 1 waits in report(), which must end the job within REPORT_TIMEOUT_S."""
    from cs336_systems.doctor import JobDoctor

    torch.set_num_threads(1)
    model = _model(ctx, HEALTHY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(ctx, HEALTHY)
    doctor = JobDoctor(model, optimizer, loader, report_timeout_s=REPORT_TIMEOUT_S, **OPTIONS)
    for step, (x, y) in zip(range(STEPS), loader):
        if ctx.rank == FAULTY and step == 1:
            continue
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return doctor.report(print_findings=False)
