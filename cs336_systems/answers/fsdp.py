"""Problem (fsdp, 2026 edition): fully sharded data parallelism over Linear and Embedding weights.

Handout section 7: "each GPU stores only its own slice of every weight tensor, but has to pull
slices from other GPUs to form the full weight tensor using an all-gather to prepare for a forward
or backward pass." Norms are "small enough in memory and compute that the latency overhead of a
transfer is not worth it": they stay whole on every rank and are trained as in DDP.

How a sharded layer runs, step by step (the ``_Layer`` below holds its state):

* at rest, the layer's ``weight`` parameter is this rank's block of rows: rows
  ``[rank * R, (rank + 1) * R)`` of the full ``(world_size * R, ...)`` weight. The optimizer
  (any torch optimizer, AdamW included) sees and steps only that block, in float32;
* forward: a pre-hook all-gathers the full weight (cast to ``compute_dtype`` first) and shows it
  to the layer's own forward as ``layer.weight``; the next layer's all-gather is started then, so
  that it travels while this layer computes; a post-hook takes the full weight away again;
* autograd would keep the full weight alive until backward (a Linear needs it for its input's
  gradient), so while the layer runs, ``saved_tensors_hooks`` swap it for a note of its view, and
  backward all-gathers it again when it needs it;
* the full weight's gradient is reduce-scattered: each rank receives the sum of every rank's
  gradient for its own rows, asynchronously; ``finish_gradient_synchronization`` waits and
  stores each average as the shard's ``.grad``.

What this answer does not do (the library's FSDP in cs336_systems/fsdp does): leading dimensions
that the world size does not divide, weights tied across layers, checkpoints of the full model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import Embedding, Linear  # "hook into or wrap any Linear or Embedding layer"


class _Layer:
    """One sharded Linear or Embedding: its shard, and its all-gathers and reduce-scatters."""

    def __init__(self, module: nn.Module, fsdp: FSDP):
        self.module, self.fsdp = module, fsdp
        full = module.weight.detach()
        rows, world_size = full.shape[0], fsdp.world_size
        if rows % world_size:
            raise ValueError(f"{type(module).__name__} weight of shape {tuple(full.shape)}: {rows} rows does not divide "
                             f"{world_size} ranks evenly (this answer gives each rank an equal block of rows)")
        self.full_shape = full.shape
        shard = full.chunk(world_size)[fsdp.rank].clone()  # a copy: the full weight is freed below
        module.weight = nn.Parameter(shard)  # what named_parameters() and the optimizer now see
        self.prefetched: tuple[torch.Tensor, dist.Work] | None = None

    @property
    def shard(self) -> nn.Parameter:
        return self.module._parameters["weight"]

    def start_gather(self) -> tuple[torch.Tensor, dist.Work]:
        # "When compute_dtype is provided, cast the weights to that dtype before communicating"
        shard = self.shard.detach().to(self.fsdp.compute_dtype or self.shard.dtype)
        full = torch.empty(self.full_shape, dtype=shard.dtype, device=shard.device)
        return full, dist.all_gather_into_tensor(full, shard.contiguous(), async_op=True)

    def gathered(self) -> torch.Tensor:
        """The full weight: the prefetched all-gather if one was started, else one now."""
        full, work = self.prefetched or self.start_gather()
        self.prefetched = None
        work.wait()
        return full

    def reduce_scatter(self, grad: torch.Tensor) -> None:
        # Master gradients are float32, and so is their sum over ranks; dividing first makes
        # the sum an average, as DDP's.
        grad = grad.to(self.shard.dtype).div(self.fsdp.world_size).contiguous()
        out = torch.empty_like(self.shard)
        self.fsdp.pending.append((self, out, dist.reduce_scatter_tensor(out, grad, async_op=True)))


class _GatherWeight(torch.autograd.Function):
    """Forward: the shard -> the full weight. Backward: the full weight's gradient -> a
    reduce-scatter in flight, whose result finish_gradient_synchronization stores as the
    shard's .grad (so autograd gets no gradient for the shard from here)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, layer: _Layer) -> torch.Tensor:
        ctx.layer = layer
        return layer.gathered()

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.layer.reduce_scatter(grad_full)
        return None, None


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        """'construct an FSDP module that will handle weight all-gathers and gradient
        reduce-scatters.'"""
        super().__init__()
        self.module, self.compute_dtype = module, compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pending: list[tuple[_Layer, torch.Tensor, dist.Work]] = []  # reduce-scatters in flight
        self.replicated_handles: list[dist.Work] = []  # all-reduces of the norms' gradients
        # Every rank starts from rank 0's model, before anything is cut into shards.
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        # modules() lists layers in the order they are registered; for the course's transformer
        # that is the order forward calls them, which the prefetch below relies on.
        self.layers = [_Layer(m, self) for m in module.modules() if isinstance(m, (Linear, Embedding))]
        self.next_layer = {a.module: b for a, b in zip(self.layers, self.layers[1:])}
        self.layer_of = {layer.module: layer for layer in self.layers}
        for layer in self.layers:
            layer.module.register_forward_pre_hook(self._before_layer_forward)
            layer.module.register_forward_hook(self._after_layer_forward)
        sharded = {id(layer.shard) for layer in self.layers}
        for param in module.parameters():
            if param.requires_grad and id(param) not in sharded:
                param.register_post_accumulate_grad_hook(self._all_reduce_replicated)

    # Forward: gather just in time, one layer ahead, and free after use.
    def _before_layer_forward(self, module: nn.Module, inputs) -> None:
        layer = self.layer_of[module]
        # "all-gather the weights in time for the forward pass": an instance attribute comes
        # before nn.Module's parameter lookup, so the layer's own forward reads the full weight
        # while named_parameters() still lists the shard.
        module.__dict__["weight"] = _GatherWeight.apply(layer.shard, layer)
        # "To limit memory use, only start gathering after the layer two before the current one
        # has completed its forward pass": the next layer's all-gather starts now, when the
        # layer before this one has finished, and runs while this one computes.
        following = self.next_layer.get(module)
        if following is not None and following.prefetched is None:
            following.prefetched = following.start_gather()
        # Autograd saves the full weight for backward; save a note instead (see _pack).
        layer.saving = torch.autograd.graph.saved_tensors_hooks(self._pack_for(layer), self._unpack_for(layer))
        layer.saving.__enter__()

    def _after_layer_forward(self, module: nn.Module, inputs, output) -> None:
        layer = self.layer_of[module]
        layer.saving.__exit__(None, None, None)
        del module.__dict__["weight"]  # "Make sure to free the gathered weights after use."

    def _pack_for(self, layer: _Layer):
        def pack(saved: torch.Tensor):
            full = layer.module.__dict__["weight"]
            if saved.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                return ("full weight", saved.size(), saved.stride(), saved.storage_offset())
            return saved
        return pack

    def _unpack_for(self, layer: _Layer):
        def unpack(packed):
            if isinstance(packed, tuple):  # "In the backward pass, ... all-gather to have the
                _, size, stride, offset = packed  # weights available for the computation."
                return layer.gathered().as_strided(size, stride, offset)
            return packed
        return unpack

    def _all_reduce_replicated(self, param: nn.Parameter) -> None:
        param.grad.div_(self.world_size)
        self.replicated_handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *inputs, **kwargs):
        output = self.module(*inputs, **kwargs)
        for layer in self.layers:  # a layer prefetched that forward then did not call
            if layer.prefetched is not None:
                layer.gathered()
        return output

    def finish_gradient_synchronization(self) -> None:
        """'When called, wait for asynchronous communication calls to finish on the GPU', and
        give each shard its averaged gradient, float32 (the master weights' dtype)."""
        for layer, out, work in self.pending:
            work.wait()
            shard = layer.shard
            shard.grad = out if shard.grad is None else shard.grad + out  # accumulates as autograd would
        self.pending.clear()
        for handle in self.replicated_handles:
            handle.wait()
        self.replicated_handles.clear()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full float32 value, named as in the wrapped module (all ranks call)."""
        shards = {id(layer.shard): layer for layer in self.layers}
        full = {}
        for name, param in self.module.named_parameters():
            layer = shards.get(id(param))
            if layer is None:
                full[name] = param.detach().clone()
            else:
                full[name] = torch.empty(layer.full_shape, dtype=param.dtype, device=param.device)
                dist.all_gather_into_tensor(full[name], param.detach().contiguous())
        return full
