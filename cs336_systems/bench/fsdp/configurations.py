"""The four ways the FSDP benchmark trains the LM, each on its own copy of the model.

* ``ddp``: :class:`~cs336_systems.ddp.BucketedDDP` (25 MB buckets) and AdamW: every rank holds
  the whole model, its gradients and its optimizer state;
* ``zero1``: the same DDP with :class:`~cs336_systems.zero.ShardedOptimizer` over AdamW (the
  sharded optimizer; like ZeRO stage 1 it shards optimizer state, but in FP32 and only AdamW's moments,
  and its owners broadcast updated parameters): optimizer state sharded;
* ``fsdp``: our :class:`~cs336_systems.fsdp.FullyShardedDataParallel` in its default
  reduce-scatter mode (ZeRO stage 3), the FSDP ``adapters.get_fsdp`` builds: parameters,
  gradients and optimizer state sharded (the record's ``fsdp_mode`` names the mode timed);
* ``torch-fsdp``: ``torch.distributed.fsdp.fully_shard`` on every Transformer block and then
  the model (torch's FSDP2, the layout its documentation recommends), at its defaults.

All use AdamW with the same hyperparameters and compute in float32.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.bench.fsdp.formulas import DDP, FSDP, TORCH_FSDP, ZERO1
from cs336_systems.bench.workload import Workload
from cs336_systems.ddp import BucketedDDP
from cs336_systems.ddp.auto_bucket import DEFAULT_BUCKET_MB
from cs336_systems.fsdp import FullyShardedDataParallel
from cs336_systems.zero import ShardedOptimizer

CONFIGURATIONS = (DDP, ZERO1, FSDP, TORCH_FSDP)
DESCRIPTIONS = {
    DDP: "bucketed DDP (25 MB buckets), AdamW",
    ZERO1: "bucketed DDP (25 MB buckets), AdamW under our sharded optimizer",
    FSDP: "our FSDP (reduce-scatter mode), AdamW on the shards",
    TORCH_FSDP: "torch's fully_shard per block and on the model, AdamW on the shards",
}
LR = 1e-4
PHASES = ("forward", "backward", "finish", "optimizer_step")


@dataclass
class Configuration:
    """One configuration as run: what forward is called on, its optimizer, its finishing call."""

    name: str
    model: nn.Module  # called on the tokens
    module: nn.Module  # the LM inside (its parameters are what this rank holds)
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None] | None  # after backward, before the step (None: inside backward)

    def step(self, work: Workload) -> dict[str, tuple[float, float]]:
        """One training step; the (start, end) clock of each phase (``time.perf_counter``)."""
        clock = [time.perf_counter()]
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(work.tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), work.targets.flatten())
        clock.append(time.perf_counter())
        loss.backward()
        clock.append(time.perf_counter())
        if self.finish is not None:
            self.finish()
        clock.append(time.perf_counter())
        self.optimizer.step()
        clock.append(time.perf_counter())
        return {phase: (clock[i], clock[i + 1]) for i, phase in enumerate(PHASES)}


def _torch_fsdp(module: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh  # imported late: absent from some builds
    from torch.distributed.fsdp import fully_shard

    # The mesh over the group we already joined, on the model's device. Without one,
    # fully_shard builds a default mesh on CUDA whenever a GPU is visible and moves rank r to
    # cuda:r, which fails for a CPU run on a GPU machine and for ranks sharing one GPU.
    mesh = DeviceMesh.from_group(dist.group.WORLD, next(module.parameters()).device.type)
    for block in module.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def build_configuration(name: str, base: nn.Module) -> Configuration:
    """Configuration ``name`` on a copy of ``base`` (collective: all ranks build alike, in order)."""
    module = copy.deepcopy(base)
    if name in (DDP, ZERO1):
        ddp = BucketedDDP(module, bucket_size_mb=DEFAULT_BUCKET_MB)
        if name == DDP:
            optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        else:
            optimizer = ShardedOptimizer(module.parameters(), torch.optim.AdamW, lr=LR)
        return Configuration(name, ddp, module, optimizer, ddp.finish_gradient_synchronization)
    if name == FSDP:
        fsdp = FullyShardedDataParallel(module)
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=LR)
        return Configuration(name, fsdp, module, optimizer, fsdp.finish_gradient_synchronization)
    if name == TORCH_FSDP:
        model = _torch_fsdp(module)
        return Configuration(name, model, module, torch.optim.AdamW(model.parameters(), lr=LR), None)
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGURATIONS)}")
