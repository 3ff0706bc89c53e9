"""A gradient bucket (one flat buffer, its pending count, its async work) and the plan that maps
parameters to buckets.

A bucket holds the gradients of parameters sharing a dtype and device, back to back, followed
by one usage flag per parameter (1 if this rank has its gradient, else 0). One all-reduce then
reduces the gradients and, in the same call, the flags, which say whether a gradient missing on
this rank is filled in (some rank used the parameter) or left ``None`` (no rank did). The flags
are written on the device, so packing never copies host data in; only a rank that lacks a
gradient reads them back.

Two options trade generality for speed:

* ``grad_views``: each parameter's ``.grad`` becomes a view into the buffer (torch DDP's
  ``gradient_as_bucket_view``), so the reduced values need no copy back and, when gradients
  are zeroed rather than set to ``None``, backward accumulates straight into the buffer;
* ``comm_dtype``: communicate in a narrower dtype (e.g. bfloat16: half the bytes). The sum is
  then taken in that dtype and the average formed afterwards in the parameter's dtype, so the
  division does not add a second rounding in low precision.

Flat DDP uses one bucket per dtype and device; bucketed DDP many, planned by
:func:`plan_buckets`. :func:`bucket_cap_bytes` is the one check of a ``bucket_size_mb``, for
DDP's buckets and the sharded optimizer's broadcasts alike.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.ddp.mean_all_reduce import MeanAllReduce
from cs336_systems.units import MB


def bucket_cap_bytes(bucket_size_mb: float) -> float:
    """``bucket_size_mb`` MB in bytes (MB = 2**20 bytes, as torch DDP's ``bucket_cap_mb``);
    ValueError unless it is a finite number > 0."""
    is_number = isinstance(bucket_size_mb, (int, float)) and not isinstance(bucket_size_mb, bool)
    if not (is_number and math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
        raise ValueError(f"bucket_size_mb must be a finite number > 0, got {bucket_size_mb!r}")
    return float(bucket_size_mb) * MB


def plan_buckets(
    params: Sequence[nn.Parameter], cap_bytes: float, first_cap_bytes: float | None = None
) -> list[list[int]]:
    """Group parameter indices into buckets, keeping order, as torch's DDP does.

    Each (dtype, device) kind fills its own open bucket; a parameter always joins it, and the
    bucket closes once it holds ``cap_bytes`` or more, so a parameter larger than the cap closes
    the bucket it joined. Each kind's first bucket closes at ``first_cap_bytes`` instead, if that
    is smaller. This is ``compute_bucket_assignment_by_size`` of torch's reducer
    (torch/csrc/distributed/c10d/reducer.cpp; ``tests/test_bucket_plan.py`` compares the two).
    It never makes more buckets than closing a bucket before the cap would be exceeded: each
    of its buckets ends where the other rule's bucket of the same position ends, or later. Buckets
    are listed in the order they close (the order their last gradient is expected, which is
    how torch orders its rebuilt buckets), the ones still open at the end after them, in the
    order of their last parameters.
    """
    buckets: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], float]] = {}  # kind -> (indices, bytes)
    past_first: set[tuple] = set()  # kinds whose first bucket has closed
    for i, param in enumerate(params):
        kind = (param.dtype, param.device)
        indices, used = open_buckets.pop(kind, ([], 0.0))
        indices.append(i)
        used += param.numel() * param.element_size()
        cap = cap_bytes
        if first_cap_bytes is not None and kind not in past_first:
            cap = min(cap_bytes, first_cap_bytes)
        if used >= cap:
            buckets.append(indices)
            past_first.add(kind)
        else:
            open_buckets[kind] = (indices, used)  # re-inserted: last in the order of last parameters
    buckets.extend(indices for indices, _ in open_buckets.values())
    return buckets


def read_together(groups: Sequence[Sequence[torch.Tensor]]) -> list[list[float]]:
    """The values of groups of device scalars, in one host-device wait for all of them, and in
    none when there are none (a step in which this rank has every gradient)."""
    scalars = [t for group in groups for t in group]
    if not scalars:
        return [[] for _ in groups]
    values = iter(torch.stack(scalars).tolist())
    return [[next(values) for _ in group] for group in groups]


class Reduction(Protocol):
    """Gradients being all-reduced: a bucket, or one parameter."""

    def wait(self) -> None:
        """Wait for the all-reduce (it runs asynchronously once launched)."""

    def missing_usage(self) -> list[torch.Tensor]:
        """After :meth:`wait`: device scalars saying how many ranks had each gradient missing
        here (empty when none is missing: the usual step)."""

    def write_grads(self, world_size: int, missing_usage: Sequence[float]) -> None:
        """After :meth:`wait`: put the averaged gradients in ``.grad``, given the values of
        :meth:`missing_usage` (a gradient no rank had stays ``None``)."""


def write_reduced_grads(reductions: Sequence[Reduction], world_size: int) -> None:
    """Wait for every all-reduce, then write the averaged gradients back.

    The usage of all missing gradients is read in one host-device wait, after every collective
    has been issued; a rank that has every gradient does not wait for the device at all.
    """
    for reduction in reductions:
        reduction.wait()
    usage = read_together([reduction.missing_usage() for reduction in reductions])
    for reduction, values in zip(reductions, usage):
        reduction.write_grads(world_size, values)


class GradBucket:
    """Gradients reduced by one all-reduce: their flat buffer, the count of gradients still
    pending in this backward pass, and the async work reducing them."""

    def __init__(
        self,
        params: list[nn.Parameter],
        comm_dtype: torch.dtype | None = None,
        grad_views: bool = False,
    ):
        if not params:
            raise ValueError("a GradBucket needs at least one parameter")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"parameters of one bucket must share dtype and device, got {kinds}")
        param_dtype = params[0].dtype
        self.comm_dtype = comm_dtype or param_dtype
        if grad_views and self.comm_dtype != param_dtype:
            raise ValueError(
                f"gradients cannot be views of a {self.comm_dtype} buffer for {param_dtype} "
                "parameters: use grad_views=False with comm_dtype"
            )
        self.params = params
        self.grad_views = grad_views
        self.numels = [p.numel() for p in params]
        grad_numel = sum(self.numels)
        self.data = torch.zeros(grad_numel + len(params), dtype=self.comm_dtype, device=params[0].device)
        self.flags = self.data[grad_numel:]
        self._slots = list(torch.split(self.data[:grad_numel], self.numels))
        self._index = {id(p): i for i, p in enumerate(params)}
        # Average inside the collective when it runs in the parameters' own dtype, as torch's
        # DDP does; with a narrower comm dtype, sum there and divide after, in full width.
        self.averaged_in_comm = self.comm_dtype == param_dtype
        self.missing: list[int] = []  # set by pack(): positions with no local gradient
        self.pending = len(params)
        self.work: dist.Work | None = None

    @property
    def payload_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _is_view(self, i: int) -> bool:
        grad = self.params[i].grad
        return grad is not None and grad.data_ptr() == self._slots[i].data_ptr()

    def mark_ready(self, param: nn.Parameter) -> None:
        """Called from the gradient hook once ``param``'s gradient is final. With
        ``grad_views`` its gradient moves into its slot now, so the copies spread over backward."""
        self.pending -= 1
        i = self._index[id(param)]
        if not self.grad_views or param.grad is None or self._is_view(i):
            return
        self._slots[i].copy_(param.grad.reshape(-1))
        param.grad = self._slots[i].view_as(param)

    def pack(self) -> None:
        """Bring every local gradient into the buffer (zeros where missing) and set the flags."""
        missing = []
        for i, (param, slot) in enumerate(zip(self.params, self._slots)):
            if param.grad is None:
                slot.zero_()
                missing.append(i)
            elif not self._is_view(i):
                slot.copy_(param.grad.reshape(-1))
                if self.grad_views:
                    param.grad = slot.view_as(param)
        self.flags.fill_(1)
        for i in missing:
            self.flags[i].fill_(0)
        self.missing = missing

    def launch(self, comm: MeanAllReduce) -> None:
        """Pack, then start the async all-reduce of the whole buffer."""
        self.pack()
        reduce = comm.mean if self.averaged_in_comm else comm.sum
        self.work = reduce(self.data, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def missing_usage(self) -> list[torch.Tensor]:
        """The reduced flags of the gradients missing here (device scalars; read after wait)."""
        return [self.flags[i] for i in self.missing]

    def write_grads(self, world_size: int, missing_usage: Sequence[float] = ()) -> None:
        """Write the averaged gradients back; leave ``None`` those that no rank produced.

        ``missing_usage``: the values of :meth:`missing_usage`, read after :meth:`wait`.
        """
        if len(missing_usage) != len(self.missing):
            raise ValueError(
                f"expected {len(self.missing)} flags, one per missing gradient, got {len(missing_usage)}"
            )
        if self.grad_views and not self.missing:
            return  # pack() made every gradient a view of the reduced buffer
        unused = {i for i, flag in zip(self.missing, missing_usage) if flag == 0}
        for i, (param, slot) in enumerate(zip(self.params, self._slots)):
            if i in unused:
                continue
            if self.grad_views:
                if not self._is_view(i):
                    param.grad = slot.view_as(param)
                continue
            reduced = slot.view_as(param)
            if not self.averaged_in_comm:
                reduced = reduced.to(param.dtype) / world_size
            if param.grad is None:
                param.grad = reduced.to(param.dtype, copy=True)
            else:
                param.grad.copy_(reduced)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
