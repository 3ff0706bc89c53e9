"""Overlapped per-parameter DDP (problem 5): one async all-reduce per gradient, started in backward.

Each parameter's gradient is all-reduced in place as soon as backward has produced it, so the
communication of late layers overlaps the backward computation of early ones. The per-call
cost is still paid once per parameter; bucketing (bucketed.py) amortises it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.ddp.base import UsageCount
from cs336_systems.ddp.mean_all_reduce import MeanAllReduce
from cs336_systems.ddp.overlap import OverlappedDataParallel, ReductionUnit


class ParameterUnit(ReductionUnit):
    """One parameter, reduced in place in its own ``.grad`` (no copy)."""

    def __init__(self, param: nn.Parameter):
        super().__init__([param])
        self.stand_in: torch.Tensor | None = None  # zeros sent when this rank has no gradient

    def launch(self, comm: MeanAllReduce) -> None:
        param = self.params[0]
        grad = param.grad
        if grad is None:
            self.stand_in = grad = torch.zeros_like(param)
        self.work = comm.mean(grad, async_op=True)

    def reset(self) -> None:
        super().reset()
        self.stand_in = None


class PerParameterDDP(OverlappedDataParallel):
    """Per-parameter overlapped DDP; call :meth:`finish_gradient_synchronization` before the step.

    Besides one all-reduce per parameter, each step ends with one small all-reduce counting,
    per parameter, the ranks that produced its gradient (see base.py on unused parameters).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **options: bool):
        """``options``: OverlappedDataParallel's (``reorder_after_first_step``, ``broadcast_buffers``)."""
        super().__init__(module, process_group, **options)
        self._usage = UsageCount(self.synced_params, self.comm)
        self._missing: list[int] = []
        self._install_units(self._build_units(self._initial_order()))

    def _build_units(self, params_in_launch_order: Sequence[nn.Parameter]) -> list[ReductionUnit]:
        return [ParameterUnit(p) for p in params_in_launch_order]

    def _after_all_launched(self) -> int:
        # Launched last, on every rank, so collective order stays the same everywhere.
        self._missing = self._missing_grads()
        self._usage.start(self._missing)
        return 1

    def _complete_units(self) -> None:
        for i, count in zip(self._missing, self._usage.read(self._missing)):
            param = self.synced_params[i]
            unit = self._unit_of[id(param)]
            if count > 0:  # some rank used it: adopt the reduced zeros-plus-theirs
                param.grad = unit.stand_in
