"""Rank functions of the Lightning strategy tests: the same fit with Lightning's ``DDPStrategy`` and ours.

Every rank function runs under ``cs336_systems.launch.launch`` (spawned ranks, gloo on CPU,
the process group already up: Lightning joins it instead of starting its own, because
``LOCAL_RANK`` is set), and returns plain tensors the test compares in the parent process.
Lightning starts slowly, so one launch runs many fits: a case list, each case fitted once per
strategy, in the same processes.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, HIDDEN, CLASSES = 8, 16, 4
ROWS = 64  # examples in the data set: 8 steps of 4 per rank at world size 2


@dataclass(frozen=True)
class FitCase:
    """One Trainer configuration, fitted with each strategy named in ``strategies``."""

    name: str
    steps: int = 4  # optimizer steps
    precision: str = "32-true"
    accumulate: int = 1  # accumulate_grad_batches
    clip: float | None = None  # gradient_clip_val (norm)
    batchnorm: bool = True
    sync_batchnorm: bool = False
    resume_at: int | None = None  # stop after this many steps, then resume from its checkpoint
    strategies: tuple[str, ...] = ("lightning", "bucketed")
    ours: dict[str, Any] = field(default_factory=dict)  # CS336DDPStrategy options beyond variant


def quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=g) * 2 + 1
    return TensorDataset(x, torch.randint(0, CLASSES, (ROWS,), generator=g))


def build_module(case: FitCase, lr: float = 0.1) -> Any:
    """A classifier with (optionally) BatchNorm; the same seeded weights every call."""
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            norm: nn.Module = nn.BatchNorm1d(HIDDEN) if case.batchnorm else nn.Identity()
            self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), norm, nn.ReLU(), nn.Linear(HIDDEN, CLASSES))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return Classifier()


def make_strategy(name: str, case: FitCase) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from cs336_systems.lightning import CS336DDPStrategy

    if name == "lightning":
        return DDPStrategy(process_group_backend="gloo")
    return CS336DDPStrategy(variant=name, process_group_backend="gloo", **case.ours)


def fit(strategy_name: str, case: FitCase, steps: int, devices: int = 2, ckpt_in: str | None = None,
        ckpt_out: str | None = None, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """Fit ``case`` for ``steps`` optimizer steps; the module's state dict afterwards."""
    import lightning.pytorch as pl

    module = build_module(case)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=make_strategy(strategy_name, case) if devices > 1 else "auto",
        max_steps=steps, precision=case.precision, accumulate_grad_batches=case.accumulate,
        gradient_clip_val=case.clip, sync_batchnorm=case.sync_batchnorm, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit_cases(ctx: Any, cases: list[FitCase], folder: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Per case, per strategy: the final state dict (``"<strategy>/resumed"`` too for resume cases);
    checkpoints go to ``folder``, which every rank can read (they share one machine)."""
    quiet_lightning()
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for case in cases:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name in case.strategies:
            out[name] = fit(name, case, case.steps)
            if case.resume_at is not None:
                path = os.path.join(folder, f"{case.name}-{name}.ckpt")  # rank 0 writes it
                fit(name, case, case.resume_at, ckpt_out=path)
                out[f"{name}/resumed"] = fit(name, case, case.steps, ckpt_in=path)
        results[case.name] = out
    return results
