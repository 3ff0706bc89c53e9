"""Exact-gradient mode: every layer's parameter gradient recomputed over the whole global batch.

Why it exists. Reduce-scattering per-rank partial gradients (the default) rounds differently
from one process training on the whole batch: a float32 weight gradient ``G^T X`` summed over
all rows in one chain (MKL on a CPU) is not the sum of two half-batch chains added afterwards.
The public 2026 tests compare FSDP with single-process training bitwise in float32, which no
reduction of partial sums can meet. This mode meets it by doing the single process's own
arithmetic: for each use of a layer in backward, the layer's input and its output gradient are
all-gathered across ranks (rank order is the global batch's row order: data-parallel sharding
gives each rank a contiguous slice of rows), the layer's own ``forward`` is rerun on the
gathered input with the full parameters, and ``torch.autograd.grad`` produces the parameter
gradients of the whole batch. Every rank computes the same numbers; each divides by the world
size (each rank's loss averaged over its own rows, so its output gradient is world-size times
the single process's, a power of two at world size 2 and so exact) and keeps its shard.

Which parameters. An *exact layer* is a leaf module (no children) owning trainable parameters:
Linear and Embedding (sharded weight; an ``nn.Linear`` bias is replicated), RMSNorm and
LayerNorm (replicated gain and bias). Batch norm is left out: in training it normalises over the
rank's whole batch, so its output rows are not a function of its input rows alone and a
recomputation over the gathered batch would differentiate another function; its parameters
keep the all-reduce path. A layer must take positional tensor arguments whose first dimension is the
batch, the same shape on every rank, and return one tensor. Parameters owned by a module with
children (say a free scale on the model itself) cannot be recomputed layer by layer: they keep
the default path, an all-reduce of per-rank gradients, and so match only within rounding.

Cost. Instead of reduce-scattering gradients, each use all-gathers its input and its output
gradient (world size times the activation bytes of that layer, both ways), and every rank
recomputes the weight gradient of the whole global batch, world size times its share of that
matmul; and a copy of each layer's output (see ``_ExactUse``). Autograd no longer computes the
local parameter gradients (the layers see detached parameters), which pays back a little.

Overlap. A use's two gathers are launched when its output gradient arrives (the input is only
gathered then, not in forward, so at most two uses' gathered activations are alive rather than
every layer's from forward to backward) and waited for when the next use's gradient arrives,
so they overlap the layer's own input-gradient computation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.fsdp.sharded_weight import ShardedWeight


@dataclass
class ExactLayer:
    """A leaf module whose parameter gradients are recomputed over the global batch."""

    name: str  # the module's name in the wrapped model
    module: nn.Module
    weight: ShardedWeight | None  # its sharded weight, if it is a Linear or Embedding
    replicated: list[str]  # names of its trainable replicated parameters (bias, gain)

    def is_sharded(self, name: str) -> bool:
        """Whether ``name`` is this layer's sharded weight (a norm's ``weight`` is replicated)."""
        return name == "weight" and self.weight is not None

    def trainable(self) -> list[str]:
        names = list(self.replicated)
        if self.weight is not None and self.weight.shard.requires_grad:
            names.insert(0, "weight")
        return names


@dataclass
class _Use:
    """One call of an exact layer whose gradient backward will need."""

    layer: ExactLayer
    inputs: tuple  # positional arguments as the layer got them on this rank
    versions: tuple  # their tensors' in-place versions then, to catch a later in-place change
    works: list[dist.Work] = field(default_factory=list)
    gathered: list = field(default_factory=list)  # global inputs, then the output gradient


class _ExactUse(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to the schedule.

    The layer's trainable parameters are extra inputs so that the output requires grad even
    when the layer's input does not (an embedding); their gradient is not autograd's to give.
    The output is a copy, not the input returned as is: autograd treats that as a view, and a
    model could not then modify the layer's output in place.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, exact: ExactGradients, use: _Use, *params):
        ctx.exact, ctx.use, ctx.nparams = exact, use, len(params)
        return out.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ctx.exact.on_output_grad(ctx.use, grad_out)
        return (grad_out, None, None, *([None] * ctx.nparams))


def _gather_rows(tensor: torch.Tensor, world_size: int, group) -> tuple[dist.Work, torch.Tensor]:
    """Launch the all-gather of ``tensor`` along its first dimension, ranks in order."""
    send = tensor.detach().contiguous()
    out = torch.empty((world_size * send.shape[0], *send.shape[1:]), dtype=send.dtype, device=send.device)
    return dist.all_gather_into_tensor(out, send, group=group, async_op=True), out


class ExactGradients:
    """Records exact layers' uses in forward, gathers and recomputes them in backward."""

    def __init__(self, layers: list[ExactLayer], schedule, world_size: int, group=None):
        self.layers = layers
        self.schedule = schedule  # gathers full weights and takes sharded weights' gradients
        self.world_size = world_size
        self.group = group
        self._pending: deque[_Use] = deque()
        self._sums: dict[nn.Parameter, torch.Tensor] = {}  # replicated grads summed over uses
        self._masters: dict[nn.Module, dict[str, nn.Parameter]] = {}  # swapped out for a call
        self.params = {id(layer.module._parameters[n]) for layer in layers for n in layer.replicated}

    # -- forward -------------------------------------------------------------------------------

    def pre_forward(self, layer: ExactLayer, args: tuple, kwargs: dict) -> None:
        """Give the layer detached replicated parameters for this call (cast like its weight)."""
        if kwargs:
            raise TypeError(
                f"exact-gradient FSDP recomputes {layer.name} from its positional arguments; "
                f"it was called with keyword arguments {sorted(kwargs)}"
            )
        module = layer.module
        masters = {name: module._parameters[name] for name in layer.replicated}
        self._masters[module] = masters
        dtype = layer.weight.compute_dtype if layer.weight is not None else None
        for name, param in masters.items():
            module._parameters[name] = self._cast(param, dtype).detach()

    def post_forward(self, layer: ExactLayer, args: tuple, out):
        module = layer.module
        module._parameters.update(self._masters.pop(module, {}))
        names = layer.trainable()
        if not torch.is_grad_enabled() or not names or out is None:
            return None
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"exact-gradient FSDP needs {layer.name} to return one tensor, got {type(out).__name__}"
            )
        params = [layer.weight.shard if layer.is_sharded(n) else module._parameters[n] for n in names]
        versions = tuple(a._version if isinstance(a, torch.Tensor) else None for a in args)
        return _ExactUse.apply(out, self, _Use(layer, args, versions), *params)

    @staticmethod
    def _cast(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if dtype is None or param.dtype == dtype or not param.is_floating_point():
            return param
        return param.to(dtype)

    # -- backward ------------------------------------------------------------------------------

    def on_output_grad(self, use: _Use, grad_out: torch.Tensor) -> None:
        """Launch the gathers of this use, then finish the use before it (overlap by one)."""
        self.schedule.note_backward()
        for arg, version in zip(use.inputs, use.versions):
            if isinstance(arg, torch.Tensor) and arg._version != version:
                raise RuntimeError(
                    f"exact-gradient FSDP recomputes {use.layer.name}'s gradient from its input, but that "
                    "input was modified in place after the layer used it; compute it out of place"
                )
        weight = use.layer.weight
        if weight is not None:
            self.schedule.start_gather(weight)  # the recompute needs it; usually prefetched
        for item in (*use.inputs, grad_out):
            if isinstance(item, torch.Tensor):
                work, gathered = _gather_rows(item, self.world_size, self.group)
                use.works.append(work)
                item = gathered
            use.gathered.append(item)
        use.inputs = ()
        self._pending.append(use)
        while len(self._pending) > 1:
            self._recompute(self._pending.popleft())

    def _recompute(self, use: _Use) -> None:
        """The use's parameter gradients over the global batch, by the layer's own forward."""
        for work in use.works:
            work.wait()
        *inputs, grad_out = use.gathered
        layer, module = use.layer, use.layer.module
        dtype = layer.weight.compute_dtype if layer.weight is not None else None
        values = {}
        for name in layer.trainable():
            if layer.is_sharded(name):
                value = self.schedule.full(layer.weight)
            else:
                value = self._cast(module._parameters[name], dtype)
            values[name] = value.detach().requires_grad_()
        masters = {name: module._parameters[name] for name in values}
        module._parameters.update(values)
        try:
            with torch.enable_grad():
                out = module.forward(*inputs)
        finally:
            module._parameters.update(masters)
        grads = torch.autograd.grad(out, list(values.values()), grad_out, allow_unused=True)
        for name, grad in zip(values, grads):
            if grad is None:
                continue
            if layer.is_sharded(name):
                self.schedule.on_weight_grad(layer.weight, grad)
                continue
            master = masters[name]
            grad = grad.to(master.dtype)
            self._sums[master] = grad if master not in self._sums else self._sums[master] + grad

    def finish(self) -> None:
        """Recompute the uses still pending; install the replicated parameters' averages."""
        while self._pending:
            self._recompute(self._pending.popleft())
        for param, total in self._sums.items():
            grad = total.div_(self.world_size)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._sums = {}
