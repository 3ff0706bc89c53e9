"""``DoctorCallback``: the in-job doctor (in_job.py) in a Lightning ``Trainer``.

Three lines add it::

    from cs336_systems.doctor.callback import DoctorCallback
    trainer = Trainer(..., callbacks=[DoctorCallback()])
    trainer.fit(model, loader)        # rank 0 prints the findings when training ends, if any

It watches the batches Lightning hands ``training_step`` (and the loader they come from, with the
sampler Lightning put in it), the loss's backward, and the optimizers' steps; when training ends,
every rank gathers and judges (``JobDoctor.report``). The findings stay on the callback
(``.findings``), the same on every rank.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from cs336_systems.doctor.in_job import JobDoctor


class DoctorCallback(pl.Callback):
    """The in-job doctor for Lightning; ``JobDoctor``'s keyword options."""

    def __init__(self, **options: Any):
        self.options = options
        self.doctor: JobDoctor | None = None
        self.findings: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # one process: nothing to compare
        self.doctor = JobDoctor(None, trainer.optimizers, **self.options)
        self.doctor.watch_model(pl_module)
        loader = trainer.train_dataloader
        if isinstance(loader, torch.utils.data.DataLoader):
            self.doctor.watch_loader(loader)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.doctor is not None:
            self.doctor.on_batch(batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.doctor is not None:
            self.doctor.on_loss(loss)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.doctor is not None:
            self.findings = self.doctor.report()
