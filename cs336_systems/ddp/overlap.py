"""Overlapping gradient communication with backward: the machinery both overlapped variants share.

A post-accumulate-grad hook on each parameter tells us when its gradient is final for this
backward pass (it fires once per leaf, after all contributions are summed into ``.grad``;
see ``torch.Tensor.register_post_accumulate_grad_hook``). Gradients are grouped into *units*
(one parameter each, or one bucket each); a unit's async all-reduce starts as soon as its
last gradient is ready, so communication runs while backward computes the rest.

A unit owns its parameters, its pending count and its async work; the wrapper owns only the
launch order and a cursor into it. A variant hands this base a factory that builds its units
from the parameters in launch order (one unit per parameter, or buckets); the base builds them
at construction and again whenever the launch order changes. Units are launched strictly in that order, the same on
every rank: unit k starts only after units 0..k-1 have. Collectives are matched across ranks
by the order they are issued in, so launching in hook order would pair different tensors on
different ranks whenever ranks' autograd graphs differ (a branch taken on one rank only). The
order starts as reverse registration order (roughly the order backward produces gradients)
and, after the first step, becomes the order rank 0 actually saw, so that in steady state no
ready unit waits.

Hooks act only on a backward pass that started from this wrapper's own forward (as torch's
reducer does), so several wrappers may share one module, as the step benchmark does.

When the backward ends (base.py queues it), the rest of the step launches whatever has not
started (units whose parameters got no gradient this step, with zeros in their place), waits
for every unit and writes the averaged gradients back (``write_reduced_grads``, bucket.py).
Nothing on this path reads device memory unless some gradient is missing on this rank (see
base.py); after it the next step starts clean.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.ddp.base import DataParallel
from cs336_systems.ddp.bucket import Reduction, write_reduced_grads
from cs336_systems.ddp.mean_all_reduce import MeanAllReduce


class ReductionUnit(Reduction, Protocol):
    """Parameters reduced by one collective (a bucket, or one parameter), launched by hooks."""

    params: list[nn.Parameter]
    pending: int  # gradients of ``params`` not yet final in this backward pass

    def mark_ready(self, param: nn.Parameter) -> None:
        """Called from the hook as each of the unit's gradients becomes final."""

    def launch(self, comm: MeanAllReduce) -> None:
        """Start the unit's async all-reduce (a missing gradient counts as zeros)."""

    def reset(self) -> None:
        """Ready for the next step."""


# Builds the units of a wrapper from its parameters in launch order, the units in that order.
UnitFactory = Callable[[Sequence[nn.Parameter]], Sequence[ReductionUnit]]


class OverlappedDataParallel(DataParallel):
    """Base of per-parameter and bucketed DDP: ``build_units`` says how parameters become units."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None,
        build_units: UnitFactory,
        *,
        reorder_after_first_step: bool = True,
        **torch_keywords: Any,
    ):
        """``torch_keywords``: torch's DDP keywords (base.py, torch_keywords.py)."""
        if not isinstance(reorder_after_first_step, bool):
            raise TypeError(f"reorder_after_first_step must be True or False, got {reorder_after_first_step!r}")
        super().__init__(module, process_group, **torch_keywords)
        self._reorder_pending = reorder_after_first_step
        self._cursor = 0  # the next unit to launch
        self._ready_order: list[int] = []  # ids of parameters, in the order hooks fired
        self.launch_order: list[nn.Parameter] = list(reversed(self.synced_params))
        self.rebuild_units(build_units)

    def rebuild_units(self, build_units: UnitFactory) -> None:
        """Use ``build_units`` from now on, on the current launch order (between steps only)."""
        self._build_units = build_units
        self._units: Sequence[ReductionUnit] = build_units(self.launch_order)
        self._unit_of: dict[int, ReductionUnit] = {id(p): unit for unit in self._units for p in unit.params}

    def _reset_step(self) -> None:
        for unit in self._units:
            unit.reset()
        self._cursor = 0
        self._ready_order = []
        self._ready_ids = set()

    def _step_in_progress(self) -> bool:
        return bool(self._ready_order) or self._cursor > 0

    def _before_forward(self) -> None:
        if self._step_in_progress():
            raise RuntimeError(
                "the previous backward's gradients were never reduced (that backward did not end, "
                "or its reduction raised): call finish_gradient_synchronization() before the next forward"
            )

    def on_train_batch_start(self) -> None:
        self._check_not_released()
        self._before_forward()

    def _release_comm(self) -> None:
        for unit in self._units[: self._cursor]:  # launched in a step that was never finished
            unit.wait()
        self._units, self._unit_of = [], {}
        self._cursor = 0
        self._ready_order, self._ready_ids = [], set()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._ready_ids:
            raise RuntimeError(
                f"parameter {self._param_names.get(key, '?')!r} received a second gradient before "
                "this step's reduction ended (a backward nested in another, as reentrant activation "
                "checkpointing runs one?): use torch.utils.checkpoint with use_reentrant=False"
            )
        super()._on_grad_ready(param)
        self._ready_order.append(key)
        self._unit_of[key].mark_ready(param)
        units = self._units
        while self._cursor < len(units) and units[self._cursor].pending == 0:
            units[self._cursor].launch(self.comm)
            self._cursor += 1

    def _synchronize(self) -> None:
        for unit in self._units[self._cursor :]:
            unit.launch(self.comm)
        self._cursor = len(self._units)
        write_reduced_grads(self._units, self.world_size)
        self.allreduce_calls_last_step = len(self._units)
        if self._reorder_pending:
            self._reorder_pending = False
            self._adopt_rank0_ready_order()
        self._reset_step()

    def _adopt_rank0_ready_order(self) -> None:
        """Rebuild units in the order rank 0's gradients became ready in this step.

        Parameters that got no gradient on rank 0 keep their relative order at the end. The
        order is broadcast so that every rank launches the same units in the same order. This
        runs once, after the first step; its read of the broadcast order is its only wait.
        """
        index_of = {id(p): i for i, p in enumerate(self.synced_params)}
        seen = [index_of[key] for key in self._ready_order]
        fired = set(seen)
        rest = [i for i in reversed(range(len(self.synced_params))) if i not in fired]
        order = torch.tensor(seen + rest, dtype=torch.int64).to(self.synced_params[0].device)
        dist.broadcast(order, src=self._src, group=self.process_group)
        self.launch_order = [self.synced_params[i] for i in order.tolist()]
        self.rebuild_units(self._build_units)
