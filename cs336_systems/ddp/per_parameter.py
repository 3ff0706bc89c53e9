"""Overlapped per-parameter DDP (problem 5): one async all-reduce per gradient, started in backward.

Each parameter's gradient is all-reduced in place as soon as backward has produced it, so the
communication of late layers overlaps the backward computation of early ones. The per-call
cost is still paid once per parameter; bucketing (bucketed.py) amortises it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.ddp.base import UsageCount
from cs336_systems.ddp.mean_all_reduce import MeanAllReduce
from cs336_systems.ddp.overlap import OverlappedDataParallel, ReductionUnit


class ParameterUnit:
    """One parameter, reduced in place in its own ``.grad`` (no copy)."""

    def __init__(self, param: nn.Parameter, usage: UsageCount, index: int):
        self.params = [param]
        self.pending = 1
        self.work: dist.Work | None = None
        self.stand_in: torch.Tensor | None = None  # zeros sent when this rank has no gradient
        self.usage = usage
        self.index = index  # this parameter's position in ``usage``

    def mark_ready(self, param: nn.Parameter) -> None:
        self.pending = 0

    def launch(self, comm: MeanAllReduce) -> None:
        param = self.params[0]
        grad = param.grad
        if grad is None:
            self.stand_in = grad = torch.zeros_like(param)
        self.work = comm.mean(grad, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def missing_usage(self) -> list[torch.Tensor]:
        return [] if self.stand_in is None else [self.usage.counts[self.index]]

    def write_grads(self, world_size: int, missing_usage: Sequence[float]) -> None:
        if missing_usage and missing_usage[0] > 0:  # some rank used it: adopt zeros-plus-theirs
            self.params[0].grad = self.stand_in

    def reset(self) -> None:
        self.pending = 1
        self.work = None
        self.stand_in = None


class UsageUnit:
    """The last unit: counts, per parameter, the ranks that produced its gradient (base.py).

    It has no parameter of its own, so it launches as soon as every unit before it has, on
    every rank alike, which keeps the order of collectives the same everywhere.
    """

    def __init__(self, params: Sequence[nn.Parameter], usage: UsageCount):
        self.params: list[nn.Parameter] = []
        self.pending = 0
        self.all_params = params
        self.usage = usage

    def mark_ready(self, param: nn.Parameter) -> None:
        raise AssertionError("the usage count has no parameter of its own")

    def launch(self, comm: MeanAllReduce) -> None:
        self.usage.start([i for i, p in enumerate(self.all_params) if p.grad is None], comm)

    def wait(self) -> None:
        self.usage.wait()

    def missing_usage(self) -> list[torch.Tensor]:
        return []

    def write_grads(self, world_size: int, missing_usage: Sequence[float]) -> None:
        """The parameter units read their own counts."""

    def reset(self) -> None:
        """Nothing is kept between steps."""


def parameter_units(params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
    """One unit per parameter, then the usage count."""
    usage = UsageCount(params_in_launch_order)
    units: list[ReductionUnit] = [ParameterUnit(p, usage, i) for i, p in enumerate(params_in_launch_order)]
    return units + [UsageUnit(params_in_launch_order, usage)]


class PerParameterDDP(OverlappedDataParallel):
    """Per-parameter overlapped DDP; gradients are averaged when backward ends.

    Besides one all-reduce per parameter, each step ends with one small all-reduce counting,
    per parameter, the ranks that produced its gradient (see base.py on unused parameters).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **options: Any):
        """``options``: ``reorder_after_first_step`` and torch's DDP keywords (torch_keywords.py)."""
        super().__init__(module, process_group, parameter_units, **options)
