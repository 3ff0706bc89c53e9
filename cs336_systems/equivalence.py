"""Does DDP training equal single-process training? The check behind ``scripts/naive_ddp.py``.

Problem 2 asks for evidence that naive DDP (broadcast rank 0's weights, shard the batch,
average gradients, step) produces the same weights as one process training on the whole
batch. :func:`compare_with_single_process` trains a toy model both ways from the same initial
weights and data and reports the largest parameter difference after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.ddp import FlatDDP, NaiveDDP
from cs336_systems.launch import RankContext, run_ranks

VARIANTS = {"naive": NaiveDDP, "flat": FlatDDP}


def shard_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """Rows of a global batch that ``rank`` trains on; the batch must split evenly."""
    if batch_size % world_size != 0:
        raise ValueError(
            f"batch of {batch_size} examples cannot be split evenly over world size {world_size}"
        )
    shard = batch_size // world_size
    return slice(rank * shard, (rank + 1) * shard)


@dataclass(frozen=True)
class EquivalenceSetting:
    variant: str = "naive"  # key of VARIANTS
    world_size: int = 2  # gloo ranks on this machine
    steps: int = 10  # optimizer steps compared
    batch_size: int = 32  # global batch; each rank gets batch_size / world_size rows
    seed: int = 0  # initial weights (rank 0's) and data


def toy_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(setting: EquivalenceSetting, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(setting.seed * 1_000_003 + step)
    return torch.randn(setting.batch_size, 16, generator=g), torch.randn(setting.batch_size, 4, generator=g)


def _train_ddp(ctx: RankContext, setting: EquivalenceSetting) -> list[dict[str, torch.Tensor]]:
    rows = shard_rows(setting.batch_size, ctx.rank, ctx.world_size)
    torch.manual_seed(setting.seed + 100 * ctx.rank)  # differs per rank: DDP must broadcast
    ddp = VARIANTS[setting.variant](toy_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    history = []
    for step in range(setting.steps):
        x, y = _data(setting, step)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return history


def _train_single(setting: EquivalenceSetting) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(setting.seed)  # rank 0's seed: the weights DDP broadcasts
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for step in range(setting.steps):
        x, y = _data(setting, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


@dataclass(frozen=True)
class EquivalenceReport:
    setting: EquivalenceSetting
    max_abs_diff_per_step: list[float]  # largest |DDP - single| over parameters and ranks
    ranks_identical: bool  # all ranks hold bitwise-equal parameters after the last step

    @property
    def max_abs_diff(self) -> float:
        return max(self.max_abs_diff_per_step)


def compare_with_single_process(setting: EquivalenceSetting) -> EquivalenceReport:
    if setting.variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {setting.variant!r}")
    shard_rows(setting.batch_size, 0, setting.world_size)  # fail before spawning anything
    per_rank = run_ranks(_train_ddp, setting.world_size, args=(setting,))
    reference = _train_single(setting)
    diffs = []
    for step, expected in enumerate(reference):
        diffs.append(
            max(
                (history[step][n] - p).abs().max().item()
                for history in per_rank
                for n, p in expected.items()
            )
        )
    last = [history[-1] for history in per_rank]
    identical = all(torch.equal(h[n], last[0][n]) for h in last for n in last[0])
    return EquivalenceReport(setting, diffs, identical)
