"""Overlapped per-parameter DDP (problem 5): one async all-reduce per gradient, started in backward.

Each parameter's gradient is all-reduced in place as soon as backward has produced it, so the
communication of late layers overlaps the backward computation of early ones. The per-call
cost is still paid once per parameter; bucketing (bucketed_ddp.py) amortises it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.overlap_base import OverlappedDataParallel, ReductionUnit


class ParameterUnit(ReductionUnit):
    """One parameter, reduced in place in its own ``.grad`` (no copy)."""

    def __init__(self, param: nn.Parameter):
        self.params = [param]
        self._stand_in: torch.Tensor | None = None  # zeros sent when this rank has no gradient

    def launch(self, ddp: OverlappedDataParallel) -> dist.Work:
        param = self.params[0]
        if param.grad is None:
            self._stand_in = torch.zeros_like(param)
            tensor = self._stand_in
        else:
            tensor = param.grad
        tensor.div_(ddp.world_size)
        return ddp._all_reduce(tensor, async_op=True)

    def complete(self, ranks_with_grad: float) -> None:
        """Adopt the reduced zeros as this rank's gradient if any rank had one."""
        if self._stand_in is not None and ranks_with_grad > 0:
            self.params[0].grad = self._stand_in
        self._stand_in = None


class DDPIndividualParameters(OverlappedDataParallel):
    """Per-parameter overlapped DDP; call :meth:`finish_gradient_synchronization` before the step.

    Besides one all-reduce per parameter, each step ends with one small all-reduce counting,
    per parameter, the ranks that produced its gradient (see ddp_base.py on unused parameters).
    """

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
        return [ParameterUnit(p) for p in params_in_launch_order]

    def _after_all_launched(self) -> None:
        # Launched last, on every rank, so collective order stays the same everywhere.
        locally_used = [p.grad is not None for p in self.synced_params]
        self._usage_counts, work = self._start_usage_count(locally_used)
        self._works.append(work)

    def _complete_units(self) -> None:
        counts = dict(zip(map(id, self.synced_params), self._usage_counts.tolist()))
        for unit in self._units:
            unit.complete(counts[id(unit.params[0])])
