"""One sharded weight: its slice of the flattened weight, and the collectives that move it.

A weight of ``numel`` elements is flattened, padded with zeros to ``world_size * shard_numel``
(``shard_numel = ceil(numel / world_size)``) and cut into ``world_size`` equal slices; rank
``r`` keeps slice ``r`` as a 1-D ``nn.Parameter``. Equal slices are what
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need; the padding (at most
``world_size - 1`` elements, all on the last ranks) is zero, gets a zero gradient, and so stays
zero under SGD and AdamW alike.

:class:`ShardedWeight` keeps three invariants:

* at rest only the shard exists; the full weight's memory exists only between
  :meth:`start_gather` (or :meth:`full`) and :meth:`free`;
* the full gradient of a step is the sum over every use of the weight in that step (a tied
  weight has two), reduce-scattered once, alone or with its unit's (unit.py), after the last
  use's gradient has arrived (in exact mode, where every rank's sum is already the global
  gradient, sliced instead);
* the shard's ``.grad`` is written only by :meth:`install_grad`, after the reduction was waited
  for, so an optimizer never sees a partial sum.

What the module holds at rest (:attr:`ShardedWeight.param`). With the handout's sharding (the
wrapper's ``shard="weights"``) it is the flat shard itself. With every parameter sharded
(``fully_shard``, the wrapper's ``shard="all"``) it is what torch's ``fully_shard`` holds: a
``Shard(0)`` DTensor of the weight's own shape, whose local tensor is a view of this rank's rows
in the shard (``rows=True`` layouts cut whole rows, ``torch.chunk``'s split, padded with zero
rows). So code that reads parameters reads them as under torch: ``p.shape``, ``p.numel()`` and
``p.dim()`` are the full weight's (nanoGPT's weight-decay groups by ``p.dim() >= 2``), and
``torch.nn.utils.clip_grad_norm_`` reduces the norm over the ranks, since the gradient is a
``Shard(0)`` DTensor too. The optimizer updates the view in place, so the shard the all-gathers
send is the one it stepped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from cs336_systems.fsdp.unit import Unit, UnitGather


@dataclass(frozen=True)
class ShardLayout:
    """Where rank ``rank``'s slice of a flattened, padded weight lies."""

    shape: torch.Size  # the weight's shape in the module
    world_size: int
    rank: int
    rows: bool = False  # cut whole rows (dim 0), as a Shard(0) DTensor does; else elements

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per unit of the cut: a row of dim 0, or one element."""
        return math.prod(self.shape[1:]) if self.rows else 1

    @property
    def shard_numel(self) -> int:
        units = self.shape[0] if self.rows else self.numel
        return -(-units // self.world_size) * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        """The rows this rank holds of a ``rows`` layout (``torch.chunk``'s: the last ranks may
        hold fewer, or none)."""
        per_rank = self.shard_numel // max(self.row_numel, 1)
        held = max(0, min(self.shape[0], (self.rank + 1) * per_rank) - self.rank * per_rank)
        return torch.Size((held, *self.shape[1:]))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a new tensor; padding zeros included)."""
        flat = torch.zeros(self.padded_numel, dtype=full.dtype, device=full.device)
        flat[: self.numel] = full.reshape(-1)
        start = self.rank * self.shard_numel
        return flat[start : start + self.shard_numel].clone()

    def unflatten(self, padded: torch.Tensor) -> torch.Tensor:
        """The weight-shaped view of a gathered padded buffer (padding cut off)."""
        return padded[: self.numel].view(self.shape)


class ShardedWeight:
    """A weight kept as a shard: gathers the full value on demand, reduce-scatters gradients."""

    def __init__(
        self,
        name: str,
        weight: nn.Parameter,
        compute_dtype: torch.dtype | None,
        group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
    ):
        self.name = name  # the weight's name in the wrapped module (its first name if tied)
        self.group = group
        # A 1-D mesh over ``group``: the module then holds a Shard(0) DTensor (module docstring).
        self.mesh = mesh if weight.dim() > 0 else None
        self._stride = torch.empty(weight.shape, device="meta").stride()  # the whole weight's, contiguous
        self.layout = ShardLayout(weight.shape, dist.get_world_size(group), dist.get_rank(group),
                                  rows=self.mesh is not None)
        self.shard = nn.Parameter(
            self.layout.shard_of(weight.detach()), requires_grad=weight.requires_grad
        )
        # What the module's slot holds at rest, and the optimizer steps.
        self.param: nn.Parameter = self.shard
        if self.mesh is not None:
            self.param = nn.Parameter(self.as_dtensor(self.shard.detach()), requires_grad=weight.requires_grad)
        # The dtype the weight is gathered and computed in; master shards keep their own.
        self.compute_dtype = compute_dtype or weight.dtype
        self._padded: torch.Tensor | None = None  # the gathered buffer while it lives
        # An all-gather launched but not waited for: this weight's own, or its unit's, which
        # fills the buffer when waited for (unit.py).
        self._gather: dist.Work | UnitGather | None = None
        self.unit: Unit | None = None  # the weights gathered and reduced with it (unit.py)
        self._grad: torch.Tensor | None = None  # full-size float32 gradient summed over uses
        self._reduced: list[torch.Tensor] = []  # reduce-scattered gradient slices, unscaled
        self.uses = 0  # uses in this step's forward whose gradient is expected
        self.grads_in = 0  # of those, gradients that have arrived
        self.needs_gather_in_backward = False  # some use saved the full weight for backward
        # Recomputations (activation checkpointing) holding the gathered weight until the
        # original use's gradient arrives: the tensors they saved are views of it.
        self.recompute_holds = 0

    # -- what the module holds ---------------------------------------------------------------

    def as_dtensor(self, flat: torch.Tensor) -> DTensor:
        """A shard-sized flat tensor's valid rows (a view) as a ``Shard(0)`` DTensor of the
        weight's shape."""
        local_shape = self.layout.local_shape
        local = flat[: math.prod(local_shape)].view(local_shape)
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=self.layout.shape,
                                  stride=self._stride)

    def from_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole weight-shaped value, as :attr:`param` holds it: a DTensor,
        or the flat shard."""
        flat = self.layout.shard_of(full.detach().to(self.shard.device))
        return flat if self.mesh is None else self.as_dtensor(flat)

    # -- the full weight ---------------------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        """Gathered, or being gathered."""
        return self._padded is not None or self._gather is not None

    def storage_address(self) -> int | None:
        """Address of the gathered buffer's memory, which every view of the full weight shares
        (None until its all-gather was waited for)."""
        return None if self._padded is None else self._padded.untyped_storage().data_ptr()

    def start_gather(self) -> None:
        """Launch the all-gather of this weight alone (no-op if gathered or gathering)."""
        if self.is_gathered:
            return
        send = self.shard.detach().to(self.compute_dtype)  # cast first: fewer bytes to move
        self._padded = torch.empty(
            self.layout.padded_numel, dtype=self.compute_dtype, device=send.device
        )
        self._gather = dist.all_gather_into_tensor(
            self._padded, send, group=self.group, async_op=True
        )

    def await_gather(self, pending: UnitGather) -> None:
        """Its unit's all-gather carries this weight; waiting for it fills the buffer."""
        assert not self.is_gathered
        self._gather = pending

    def fill_gathered(self, pending: UnitGather, columns: torch.Tensor) -> None:
        """The unit's all-gather finished: copy this weight's ``world_size x shard`` columns out."""
        assert self._gather is pending
        self._padded = torch.empty(self.layout.padded_numel, dtype=columns.dtype, device=columns.device)
        self._padded.view(columns.shape).copy_(columns)
        self._gather = None

    def wait_gather(self) -> None:
        """Wait for an all-gather in flight, if any (launching none)."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None

    def padded(self) -> torch.Tensor:
        """The gathered padded buffer, waiting for (or launching) its all-gather."""
        self.start_gather()
        self.wait_gather()
        assert self._padded is not None
        return self._padded

    def full(self) -> torch.Tensor:
        """The full weight, shaped as in the module, in the compute dtype."""
        return self.layout.unflatten(self.padded())

    def free(self) -> None:
        """Release the full weight's memory now.

        The storage is shrunk to nothing rather than left to reference counting: a finished
        collective's work object (gloo's worker, NCCL's watchdog) may still hold the buffer for
        a while after ``wait()``, which would keep a third layer alive during a prefetch. Any
        view autograd saved was swapped for a marker (see schedule.py), so none is left to
        read the emptied storage.
        """
        self.wait_gather()  # never free a buffer a collective is still writing
        if self._padded is None:
            return
        self._padded.untyped_storage().resize_(0)
        self._padded = None

    # -- the gradient ------------------------------------------------------------------------

    def add_grad(self, grad: torch.Tensor) -> bool:
        """Add one use's full gradient; True when every expected use has contributed."""
        grad = grad.reshape(-1)
        if self._grad is None and self.uses == 1 and self.layout.numel == self.layout.padded_numel:
            # The common case: one use, no padding. Reduce the gradient as autograd made it.
            self._grad = grad.to(torch.float32).contiguous()
        else:
            if self._grad is None:
                self._grad = torch.zeros(
                    self.layout.padded_numel, dtype=torch.float32, device=grad.device
                )
            self._grad[: self.layout.numel].add_(grad)
        self.grads_in += 1
        return self.grads_in >= self.uses

    @property
    def has_unreduced_grad(self) -> bool:
        return self._grad is not None

    def take_grad(self) -> torch.Tensor:
        """The summed full gradient, padded (``world_size * shard_numel``), handed over to a
        reduction: the weight keeps no reference to it."""
        assert self._grad is not None
        grad, self._grad = self._grad, None
        return grad

    def reduce_scatter(self, reduce_dtype: torch.dtype = torch.float32) -> tuple[dist.Work, torch.Tensor]:
        """Launch the sum-reduce-scatter of the summed full gradient, in ``reduce_dtype``.

        Returns the work and its input: the caller keeps the input alive until the work was
        waited for, then drops it (the full gradient's memory goes with it). The output is the
        last of :attr:`reduced_slices` (hybrid sharding all-reduces it across replicas next).
        """
        full_grad = self.take_grad().to(reduce_dtype)
        out = torch.empty(self.layout.shard_numel, dtype=reduce_dtype, device=full_grad.device)
        work = dist.reduce_scatter_tensor(out, full_grad, group=self.group, async_op=True)
        self._reduced.append(out)
        return work, full_grad

    @property
    def reduced_slices(self) -> list[torch.Tensor]:
        """This step's reduced gradient slices, not yet averaged or installed."""
        return self._reduced

    def keep_own_slice(self) -> None:
        """Exact mode: the summed gradient is the global one on every rank; keep this rank's slice."""
        assert self._grad is not None
        full_grad, self._grad = self._grad, None
        start = self.layout.rank * self.layout.shard_numel
        self._reduced.append(full_grad[start : start + self.layout.shard_numel].clone())

    def install_grad(self, world_size: int) -> None:
        """After every reduction was waited for: average and add to the shard's ``.grad``."""
        for total in self._reduced:
            grad = total.to(torch.float32).div_(world_size).to(self.shard.dtype)
            param = self.param
            if param.grad is None:
                param.grad = grad if self.mesh is None else self.as_dtensor(grad)
            elif self.mesh is None:
                param.grad.add_(grad)
            else:
                local = param.grad.to_local()
                local.add_(grad[: local.numel()].view_as(local))
        self._reduced = []
        self.uses = 0
        self.grads_in = 0
