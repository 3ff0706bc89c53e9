"""The FSDP wrapper: validates, broadcasts rank 0's values, shards the weights, installs hooks.

Usage (every rank)::

    fsdp = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # steps on shards only
    loss_fn(fsdp(x_local), y_local).backward()
    fsdp.finish_gradient_synchronization()                       # wait, install shard grads
    optimizer.step()

The weights of ``Linear`` and ``Embedding`` layers (ours and torch's) are sharded; every other
parameter is replicated and its gradient averaged. ``fsdp.module`` is the original module,
whose ``named_parameters()`` yields the shards under the weights' own names.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cs336_basics.model import Embedding, Linear
from cs336_systems.fsdp.activation_checkpointing import checkpoint_layers
from cs336_systems.fsdp.checkpoint import install_state_dict_hooks
from cs336_systems.fsdp.exact import ExactGradients, ExactLayer
from cs336_systems.fsdp.options import FsdpOptions
from cs336_systems.fsdp.schedule import Schedule
from cs336_systems.fsdp.sharded_weight import ShardedWeight
from cs336_systems.fsdp.unit import build_units, unit_keys

if TYPE_CHECKING:  # imported late elsewhere: absent from some builds
    from torch.distributed.device_mesh import DeviceMesh

SHARDED_TYPES: tuple[type[nn.Module], ...] = (Linear, Embedding, nn.Linear, nn.Embedding)
COMPUTE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)

_live_wrappers: weakref.WeakSet[FullyShardedDataParallel] = weakref.WeakSet()
_step_guard: torch.utils.hooks.RemovableHandle | None = None


def _refuse_step_before_finish(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer pre-step hook: no step on shards whose gradients are still in flight.

    Checks only wrappers with a pending backward, so a correct step costs one loop over the
    (usually one) live wrapper.
    """
    for wrapper in list(_live_wrappers):
        if wrapper._schedule.grad_pending and wrapper._owns_any(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() on FSDP parameters whose gradients are still "
                "being reduced: call fsdp_model.finish_gradient_synchronization() "
                "(fsdp_on_after_backward) after backward and before the optimizer step"
            )


def _sharded_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, SHARDED_TYPES) and isinstance(m._parameters.get("weight"), nn.Parameter)
    ]


def _validate(module: object, compute_dtype: object) -> list[tuple[str, nn.Module]]:
    """Every argument check, before any collective."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be one of None (compute in the weights' dtype), torch.float32, "
            f"torch.float16 or torch.bfloat16; got {compute_dtype!r}"
        )
    layers = _sharded_modules(module)
    if not layers:
        names = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in SHARDED_TYPES)
        raise ValueError(
            f"{type(module).__name__} has no layer whose weight FSDP shards; it shards the "
            f"weights of {names}"
        )
    for name, layer in layers:
        weight = layer._parameters["weight"]
        if not weight.is_floating_point():
            raise ValueError(f"{name}.weight has dtype {weight.dtype}; FSDP shards floating weights")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FSDP needs an initialised default process group: call "
            "torch.distributed.init_process_group (or cs336_systems.launch.launch) first"
        )
    return layers


class FullyShardedDataParallel(nn.Module):
    """Shards Linear/Embedding weights over the ranks; gathers each just in time (see schedule).

    ``exact_gradients=False`` (the default): each rank's weight gradients are reduce-scattered,
    as the handout describes. ``True``: each layer's gradients are recomputed over the global
    batch from all-gathered inputs and output gradients (exact.py), bitwise equal to
    single-process training in float32 at world size 2, at a higher cost.

    The keyword-only options (``reshard_after_forward``, ``sync_module_states``,
    ``reduce_dtype``, ``activation_checkpointing``, and ``device_mesh`` or ``shard_group`` with
    ``replicate_group`` for hybrid sharding) are those of torch's ``fully_shard``, with its
    defaults; options.py describes each. ``no_sync()`` accumulates gradients without reducing.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 exact_gradients: bool = False, *, reshard_after_forward: bool = True,
                 sync_module_states: bool = True, reduce_dtype: torch.dtype | None = None,
                 activation_checkpointing: bool = False, device_mesh: DeviceMesh | None = None,
                 shard_group: dist.ProcessGroup | None = None,
                 replicate_group: dist.ProcessGroup | None = None):
        if not isinstance(exact_gradients, bool):
            raise TypeError(f"exact_gradients must be True or False, got {exact_gradients!r}")
        options = FsdpOptions(reshard_after_forward, sync_module_states, reduce_dtype,
                              activation_checkpointing, device_mesh, shard_group, replicate_group)
        options.validate(exact_gradients)
        layers = _validate(module, compute_dtype)
        super().__init__()
        self.module = module
        self.compute_dtype = compute_dtype
        self.exact_gradients = exact_gradients
        self.options = options
        self.mode = "exact-gradients" if exact_gradients else "reduce-scatter"  # as results name it
        self.world_size = dist.get_world_size()
        shard_group, replicate_group = options.groups()
        if options.shard_group is not None:
            options.grid()  # groups that form no 2-D grid are refused here, before any sharding
        if options.sync_module_states:
            self._broadcast_from_rank0()
        if options.activation_checkpointing:
            checkpoint_layers(module)

        weights: dict[int, ShardedWeight] = {}  # id(original Parameter) -> its ShardedWeight
        by_layer: dict[str, ShardedWeight] = {}
        for name, layer in layers:
            original = layer._parameters["weight"]
            if id(original) not in weights:  # a tied weight is sharded once
                weights[id(original)] = ShardedWeight(f"{name}.weight", original, compute_dtype, shard_group)
            weight = by_layer[name] = weights[id(original)]
            layer._parameters["weight"] = weight.shard
            layer.register_forward_pre_hook(lambda m, args, w=weight: self._schedule.pre_forward(m, w))
            layer.register_forward_hook(
                lambda m, args, out, w=weight: self._schedule.post_forward(m, w), always_call=True
            )
        # A block's weights are gathered and reduced together (unit.py).
        self.units = build_units(by_layer, unit_keys(module, list(by_layer)))
        self.sharded_weights = list(weights.values())
        install_state_dict_hooks(module, self.sharded_weights, options)  # torch's DCP helpers: checkpoint.py
        shards = {id(w.shard) for w in self.sharded_weights}
        replicated = [p for p in module.parameters() if id(p) not in shards]
        self._schedule = Schedule(self.units, replicated, self.world_size, group=None,
                                  exact_gradients=self.exact_gradients,
                                  reshard_after_forward=options.reshard_after_forward,
                                  reduce_dtype=options.reduce_in, replicate_group=replicate_group)
        if self.exact_gradients:
            exact = self._install_exact(weights)
            replicated = [p for p in replicated if id(p) not in exact.params]
            self._schedule.replicated = replicated
        for p in replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._schedule.on_replicated_grad)
        self._param_ids = {id(p) for p in module.parameters()}

        global _step_guard
        _live_wrappers.add(self)
        if _step_guard is None:
            _step_guard = register_optimizer_step_pre_hook(_refuse_step_before_finish)

    def _install_exact(self, weights: dict[int, ShardedWeight]) -> ExactGradients:
        """Hook every leaf module owning trainable parameters for exact-gradient mode."""
        by_shard = {id(w.shard): w for w in weights.values()}
        layers = []
        for name, m in self.module.named_modules():
            owned = {n: p for n, p in m._parameters.items() if p is not None}
            if next(m.children(), None) is not None or not owned:
                continue
            weight = by_shard.get(id(owned.get("weight")))
            replicated = [n for n, p in owned.items() if p.requires_grad and not (weight and n == "weight")]
            if weight is None and not replicated:
                continue
            layers.append(ExactLayer(name, m, weight, replicated))
        exact = ExactGradients(layers, self._schedule, self.world_size, group=None)
        self._schedule.exact = exact
        for layer in layers:
            # Registered after the schedule's hooks: the full weight is in place before, and
            # put back after, the exact hooks run.
            layer.module.register_forward_pre_hook(
                lambda m, args, kwargs, x=layer: exact.pre_forward(x, args, kwargs), with_kwargs=True
            )
            layer.module.register_forward_hook(
                lambda m, args, out, x=layer: exact.post_forward(x, args, out), always_call=True
            )
        return exact

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Start every rank from rank 0's parameters and buffers, as DDP does."""
        seen: set[int] = set()
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                dist.broadcast(tensor.data, src=0)

    def _owns_any(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])

    def forward(self, *args, **kwargs):
        if self._schedule.grad_pending:
            raise RuntimeError(
                "forward started while the previous backward's gradient reductions were never "
                "finished: call fsdp_model.finish_gradient_synchronization() "
                "(fsdp_on_after_backward) after every backward, before the optimizer step"
            )
        schedule = self._schedule
        with torch.autograd.graph.saved_tensors_hooks(schedule.pack, schedule.unpack):
            schedule.begin_forward()
            try:
                return self.module(*args, **kwargs)
            finally:
                schedule.end_forward()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient reduction of this step; shards and replicas get their .grad.

        Inside :meth:`no_sync` it does nothing: the gradients wait for a synchronised backward.
        """
        self._schedule.finish()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside sum their full gradients locally and
        launch no reduction; the first backward after it reduce-scatters the sum of every
        micro-batch (one reduce-scatter per weight per step, as one large batch)."""
        previous = self._schedule.sync
        self._schedule.sync = False
        try:
            yield
        finally:
            self._schedule.sync = previous

    def release(self) -> None:
        """Let go of this wrapper's communication state before ``destroy_process_group()``.

        Waits for every reduction and all-gather still in flight and drops their work handles
        and gathered buffers, so that none is left for gloo's worker threads to destroy during
        interpreter exit (cs336_systems/launch/lifetime.py). It holds no process group of its
        own. Shards, their gradients and the optimizer are untouched; a later forward gathers
        again.
        """
        self._schedule.release()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by its name in the module (a collective: all ranks call).

        Sharded weights are all-gathered in their master dtype; replicated ones are copied.
        """
        by_shard = {id(w.shard): w for w in self.sharded_weights}
        full: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            weight = by_shard.get(id(p))
            if weight is None:
                full[name] = p.detach().clone()
                continue
            padded = torch.empty(weight.layout.padded_numel, dtype=p.dtype, device=p.device)
            dist.all_gather_into_tensor(padded, p.detach(), group=weight.group)
            full[name] = weight.layout.unflatten(padded)
        return full
