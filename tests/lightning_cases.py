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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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
    torch_ddp: dict[str, Any] = field(default_factory=dict)  # DDPStrategy's (torch DDP's) options
    fail_rank: int | None = None  # this rank raises in its training_step of batch 2
    whole_batch: bool = False  # also fit one process (in each rank alone) on the global batch of 8
    unused: bool = False  # the module holds a Linear its loss never uses


def quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=g) * 2 + 1
    return TensorDataset(x, torch.randint(0, CLASSES, (ROWS,), generator=g))


FAILURE = "this rank fails on purpose"


def build_module(case: FitCase, lr: float = 0.1) -> Any:
    """A classifier with (optionally) BatchNorm; the same seeded weights every call."""
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            norm: nn.Module = nn.BatchNorm1d(HIDDEN) if case.batchnorm else nn.Identity()
            self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), norm, nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
            if case.unused:
                self.spare = nn.Linear(HIDDEN, HIDDEN)

        def configure_model(self) -> None:
            # Lightning's ModelParallelStrategy (torch's fully_shard) leaves sharding to the module,
            # over its mesh's data-parallel dimension: each Linear a unit, then the network, as
            # CS336FSDPStrategy's auto_wrap_policy={nn.Linear}. Other strategies have no mesh.
            if self.device_mesh is None:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if case.fail_rank == self.global_rank and batch_idx == 2:
                raise RuntimeError(f"rank {self.global_rank}: {FAILURE}")
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return Classifier()


def make_strategy(name: str, case: FitCase) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from cs336_systems.lightning import CS336DDPStrategy

    if name == "lightning":
        return DDPStrategy(process_group_backend="gloo", **case.torch_ddp)
    if name == "model_parallel":  # Lightning's FSDP2 strategy: every rank a data-parallel rank
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    if name == "fsdp":
        from cs336_systems.lightning import CS336FSDPStrategy

        return CS336FSDPStrategy(process_group_backend="gloo", **case.ours)
    return CS336DDPStrategy(variant=name, process_group_backend="gloo", **case.ours)


class AllReduceCounter:
    """Counts ``torch.distributed.all_reduce`` calls per training batch (our wrappers make
    theirs through it; torch's DDP reduces in C++ and is not counted)."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        counter = self
        self.per_batch: list[int] = []
        self._calls = 0

        class Hook(pl.Callback):
            def on_train_start(self, trainer: Any, module: Any) -> None:
                original = torch.distributed.all_reduce

                def counted(*args: Any, **kwargs: Any) -> Any:
                    counter._calls += 1
                    return original(*args, **kwargs)

                counter._original = original
                torch.distributed.all_reduce = counted

            def on_train_batch_start(self, *args: Any) -> None:
                counter._calls = 0

            def on_train_batch_end(self, *args: Any) -> None:
                counter.per_batch.append(counter._calls)

            def on_train_end(self, trainer: Any, module: Any) -> None:
                torch.distributed.all_reduce = counter._original

        self.callback = Hook()


def fit(strategy_name: str, case: FitCase, steps: int, devices: int = 2, ckpt_in: str | None = None,
        ckpt_out: str | None = None, batch_size: int = 4, callbacks: tuple = ()) -> dict[str, torch.Tensor]:
    """Fit ``case`` for ``steps`` optimizer steps; the module's state dict afterwards.
    ``strategy_name`` "single": one process, Lightning's default strategy."""
    import lightning.pytorch as pl

    module = build_module(case)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, callbacks=list(callbacks),
        strategy="auto" if strategy_name == "single" else make_strategy(strategy_name, case),
        max_steps=steps, precision=case.precision, accumulate_grad_batches=case.accumulate,
        gradient_clip_val=case.clip, sync_batchnorm=case.sync_batchnorm, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    # Our own sampler, unshuffled: Lightning's would shuffle, and the single-process references
    # need each step's global batch to be the same rows (rank r takes rows r, r + 2, ...).
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=devices, rank=torch.distributed.get_rank() if devices > 1 else 0,
                                 shuffle=False)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    from torch.distributed.tensor import DTensor

    # A module our FSDP sharded yields its rows as DTensors (a collective): whole, to compare.
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


def fit_cases(ctx: Any, cases: list[FitCase], folder: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Per case, per strategy: the final state dict (``"<strategy>/resumed"`` too for resume cases);
    checkpoints go to ``folder``, which every rank can read (they share one machine)."""
    quiet_lightning()
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for case in cases:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name in case.strategies:
            counter = AllReduceCounter()
            out[name] = fit(name, case, case.steps, callbacks=(counter.callback,))
            out[f"{name}/all_reduces"] = {"per_batch": torch.tensor(counter.per_batch)}
            if case.resume_at is not None:
                path = os.path.join(folder, f"{case.name}-{name}.ckpt")  # rank 0 writes it
                fit(name, case, case.resume_at, ckpt_out=path)
                out[f"{name}/resumed"] = fit(name, case, case.steps, ckpt_in=path)
        if case.whole_batch:
            out["whole_batch"] = fit("single", case, case.steps, devices=1, batch_size=8)
        results[case.name] = out
    return results


def fit_single(ctx: Any, case: FitCase) -> dict[str, dict[str, torch.Tensor]]:
    """One process: ``case`` through our strategy on ``devices=1`` and through Lightning's default."""
    quiet_lightning()
    torch.set_num_threads(1)
    return {"ours": fit("bucketed", case, case.steps, devices=1), "single": fit("single", case, case.steps, devices=1)}


def fit_cases_then_fail(ctx: Any, cases: list[FitCase], folder: str, failing: FitCase) -> None:
    """:func:`fit_cases`, its results saved to ``folder/rank<r>.pt``, then ``failing`` (which raises
    on its ``fail_rank``): one launch both checks training and a failing rank's end."""
    results = fit_cases(ctx, cases, folder)
    results["unused_refused"] = unused_refusal()
    torch.save(results, os.path.join(folder, f"rank{ctx.rank}.pt"))
    fit_cases(ctx, [failing], folder)


def unused_refusal() -> str:
    """What our strategy says, with its default ``find_unused_parameters=False``, when the loss
    never reaches a trainable parameter (torch's DDP stops such a run too)."""
    try:
        fit("bucketed", FitCase("unused-refused", unused=True), steps=1)
    except RuntimeError as e:
        return str(e)
    return "trained without a word"
