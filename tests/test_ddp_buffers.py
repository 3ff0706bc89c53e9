"""Buffers follow torch's DDP: rank 0's buffers at the start of a forward, like torch's default.

BatchNorm updates its running statistics in forward from each rank's own data, so replicas
drift apart unless something makes them agree. torch's DDP (``broadcast_buffers=True``)
broadcasts rank 0's buffers at the start of each forward, except the forward that follows a
forward run without grad or under ``no_sync()``. Every variant here must give, on every rank
and after every step, the running statistics and parameters torch's DDP gives on that rank,
with the broadcast on and off, across a schedule that has a no-grad forward and a
``no_sync()`` micro-batch in it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_systems.ddp import VARIANTS
from cs336_systems.launch import RankContext
from tests.common import SmallCNN
from tests.rank_pool import on_pool

pytestmark = pytest.mark.problem("beyond")
WORLD_SIZE = 2
# What each step does, in order: a synchronised step; an evaluation forward without grad and
# then a step; a step whose first micro-batch runs under no_sync().
SCHEDULE = ("train", "eval-then-train", "accumulate-then-train", "train")


def _data(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Different data, of different scale, on each rank: local statistics differ a lot.
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return (1 + rank) * torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 4, generator=g)


def _train(model: nn.Module, finish, rank: int) -> list[dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    module = model.module
    history = []
    for step, kind in enumerate(SCHEDULE):
        optimizer.zero_grad(set_to_none=True)
        if kind == "eval-then-train":
            with torch.no_grad():
                model(_data(rank, step, 9)[0])
        micro_batches = 2 if kind == "accumulate-then-train" else 1
        for micro in range(micro_batches):
            x, y = _data(rank, step, micro)
            if micro < micro_batches - 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
        finish()
        optimizer.step()
        history.append({k: v.detach().clone() for k, v in module.state_dict().items()})
    return history


def _compare_with_torch(ctx: RankContext, broadcast_buffers: bool) -> dict[str, float]:
    """Largest difference from torch's DDP, per variant, over every step and state entry."""
    torch.manual_seed(ctx.rank)  # ranks start different: construction must broadcast
    start = SmallCNN()
    reference_module = SmallCNN()
    reference_module.load_state_dict(start.state_dict())
    reference = DistributedDataParallel(reference_module, broadcast_buffers=broadcast_buffers)
    expected = _train(reference, lambda: None, ctx.rank)
    worst = {}
    for name, variant in VARIANTS.items():
        module = SmallCNN()
        module.load_state_dict(start.state_dict())
        ddp = variant.wrap(module, broadcast_buffers=broadcast_buffers)
        got = _train(ddp, ddp.finish_gradient_synchronization, ctx.rank)
        worst[name] = max(
            (g[k] - e[k]).abs().max().item() if g[k].is_floating_point() else float((g[k] != e[k]).any())
            for g, e in zip(got, expected)
            for k in e
        )
        ddp.detach()
    return worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broadcast_buffers", [True, False], ids=["broadcast", "local"])
def test_running_statistics_match_torch_ddp_on_every_rank(broadcast_buffers):
    per_rank = on_pool(_compare_with_torch, WORLD_SIZE, args=(broadcast_buffers,))
    for rank, worst in enumerate(per_rank):
        assert worst == pytest.approx({name: 0.0 for name in VARIANTS}, abs=1e-6), f"rank {rank}"


def _broadcast_is_needed(ctx: RankContext) -> float:
    """How far rank 1's running mean ends from rank 0's without the broadcast (it must differ,
    or the test above could not tell the two settings apart)."""
    torch.manual_seed(0)
    ddp = VARIANTS["bucketed"].wrap(SmallCNN(), broadcast_buffers=False)
    _train(ddp, ddp.finish_gradient_synchronization, ctx.rank)
    mean = ddp.module.bn.running_mean.clone()
    gathered = [torch.zeros_like(mean) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(gathered, mean)
    return (gathered[1] - gathered[0]).abs().max().item()


@pytest.mark.timeout(300)
def test_without_the_broadcast_ranks_drift_apart():
    assert on_pool(_broadcast_is_needed, WORLD_SIZE)[0] > 1e-3
