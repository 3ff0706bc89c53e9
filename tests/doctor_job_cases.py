"""Rank functions of the in-job doctor's tests: small training jobs, healthy or with one planted
fault, in a plain PyTorch loop and in a Lightning Trainer, each with the doctor added by its three
lines. Every job runs a fixed number of steps on every rank, so a fault never hangs the run.

Faults, each on rank 1 only:

* ``no-sampler``: its DataLoader has no DistributedSampler (rank 0's has one);
* ``skips-steps``: it skips ``optimizer.step()`` at the second batch (a rank-local check), while
  its forward and backward still run, so the collectives stay paired;
* ``diverges``: it changes its own weights in its first step, before the optimizer's;
* ``straggler`` (plain loop only): its forward sleeps ``STRAGGLER_DELAY_S`` every step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cs336_systems.launch import RankContext

STEPS = 3
ROWS, FEATURES, CLASSES, BATCH = 32, 6, 3, 4
HEALTHY, NO_SAMPLER, SKIPS_STEPS, DIVERGES, STRAGGLER = "healthy", "no-sampler", "skips-steps", "diverges", "straggler"
PLAIN_JOBS = (HEALTHY, NO_SAMPLER, SKIPS_STEPS, DIVERGES, STRAGGLER)
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


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ROWS, FEATURES, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g))


def _loader(ctx: RankContext, fault: str) -> DataLoader:
    data = _data()
    if fault == NO_SAMPLER and ctx.rank == FAULTY:
        return DataLoader(data, batch_size=BATCH)
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))


def _perturb(module: nn.Module) -> None:
    with torch.no_grad():
        next(module.parameters()).add_(1e-3)


def plain_job(ctx: RankContext, fault: str) -> list[str]:
    """A plain loop with our bucketed DDP; the doctor's three lines marked."""
    from cs336_systems.ddp import BucketedDDP
    from cs336_systems.doctor import JobDoctor  # line 1

    model = BucketedDDP(Net(STRAGGLER_DELAY_S if fault == STRAGGLER and ctx.rank == FAULTY else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(ctx, fault)
    doctor = JobDoctor(model, optimizer, loader, **OPTIONS)  # line 2
    for step, (x, y) in zip(range(STEPS), loader):
        F.cross_entropy(model(x), y).backward()
        if fault == DIVERGES and ctx.rank == FAULTY and step == 0:
            _perturb(model.module)
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
