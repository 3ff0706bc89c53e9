"""The FSDP wrapper: validates, broadcasts rank 0's values, shards the weights, installs hooks.

Usage (every rank)::

    fsdp = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)   # steps on shards only
    loss_fn(fsdp(x_local), y_local).backward()                   # gradients reduced as it ends
    optimizer.step()

What is sharded (``shard=``):

* ``"weights"`` (the default, the handout's FSDP, what ``adapters.get_fsdp`` builds): the
  weights of ``Linear`` and ``Embedding`` layers (ours and torch's), each gathered around its
  own layer's call; every other parameter is replicated and its gradient averaged. A model
  that reads a Linear's weight without calling it (``nn.MultiheadAttention``) is refused.
* ``"all"``: every parameter, as torch's ``fully_shard`` applied to each element of every
  ``nn.ModuleList`` and then to the model (composable.py): any module, whatever reads it.

The wrapper is invisible to names: ``state_dict()`` and ``named_parameters()`` use the wrapped
model's own keys (``plain_model.load_state_dict(fsdp.state_dict())`` works; the state dict
holds whole tensors, gathered: a collective), and torch's ``get_model_state_dict(fsdp)`` sees
them too. ``fsdp.module`` is the wrapped model, whose own ``state_dict()`` holds this rank's rows
as ``Shard(0)`` DTensors for sharded checkpoints (checkpoint.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
from torch.distributed.tensor import DTensor

from cs336_basics.model import Embedding, Linear
from cs336_systems.fsdp.activation_checkpointing import checkpoint_layers
from cs336_systems.fsdp.checkpoint import install_state_dict_hooks
from cs336_systems.fsdp.composable import UnitPolicy, shard_units, unit_selector
from cs336_systems.fsdp.exact import ExactGradients, ExactLayer
from cs336_systems.fsdp.options import COMPUTE_DTYPES, FsdpOptions
from cs336_systems.fsdp.root import Root, adopt, units_under
from cs336_systems.fsdp.sharded_weight import ShardedWeight
from cs336_systems.fsdp.unit import Call, build_units, unit_keys

if TYPE_CHECKING:  # imported late elsewhere: absent from some builds
    from torch.distributed.device_mesh import DeviceMesh

SHARDED_TYPES: tuple[type[nn.Module], ...] = (Linear, Embedding, nn.Linear, nn.Embedding)
SHARD_CHOICES = ("weights", "all")

# torch's state-dict helpers drop this attribute's name from every key (it is how they see
# through CheckpointWrapper), so the wrapped model registered under it keeps its own keys.
_INNER = _CHECKPOINT_WRAPPED_MODULE
_PREFIX = _INNER + "."
# Modules that read a child Linear's weight without calling it: its hooks would never run.
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention,)


def _sharded_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, SHARDED_TYPES) and isinstance(m._parameters.get("weight"), nn.Parameter)
    ]


def _validate(module: object, compute_dtype: object, shard: object,
              exact_gradients: bool) -> list[tuple[str, nn.Module]]:
    """Every argument check, before any collective."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype must be one of None (compute in the weights' dtype), torch.float32, "
            f"torch.float16 or torch.bfloat16; got {compute_dtype!r}"
        )
    if shard not in SHARD_CHOICES:
        raise ValueError(f"shard must be 'weights' (Linear and Embedding weights) or 'all', got {shard!r}")
    nested = [n for n, m in module.named_modules() if isinstance(m, FullyShardedDataParallel) or "_fsdp_call" in m.__dict__]
    if nested:
        raise ValueError(
            f"{nested[0] or type(module).__name__} is sharded already; wrap the model once (shard='all' "
            "makes each nn.ModuleList element a unit), or apply cs336_systems.fsdp.fully_shard per "
            "block and then to the model"
        )
    if shard == "all":
        if exact_gradients:
            raise ValueError("exact_gradients=True runs with shard='weights' (Linear and Embedding weights) only")
        _require_process_group()
        return []
    readers = [n for n, m in module.named_modules() if isinstance(m, _READS_CHILD_WEIGHTS)]
    if readers:
        raise ValueError(
            f"{readers[0] or type(module).__name__} ({type(module.get_submodule(readers[0])).__name__}) "
            "reads its parameters without calling a Linear, so shard='weights' cannot gather them "
            "around a layer's call; pass shard='all' (every parameter, gathered per unit)"
        )
    layers = _sharded_modules(module)
    if not layers:
        names = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in SHARDED_TYPES)
        raise ValueError(
            f"{type(module).__name__} has no layer whose weight FSDP shards; it shards the "
            f"weights of {names} (shard='all' shards every parameter)"
        )
    for name, layer in layers:
        weight = layer._parameters["weight"]
        if not weight.is_floating_point():
            raise ValueError(f"{name}.weight has dtype {weight.dtype}; FSDP shards floating weights")
    _require_process_group()
    return layers


def _require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FSDP needs an initialised default process group: call "
            "torch.distributed.init_process_group (or cs336_systems.launch.launch) first"
        )


class FullyShardedDataParallel(nn.Module):
    """Shards parameters over the ranks; gathers each just in time (schedule.py).

    ``shard="weights"`` (default): Linear and Embedding weights, as the handout describes;
    ``"all"``: every parameter, unit by unit (module docstring). ``exact_gradients=False`` (the
    default): each rank's weight gradients are reduce-scattered, as the handout describes.
    ``True`` (with ``"weights"``): each layer's gradients are recomputed over the global batch
    from all-gathered inputs and output gradients (exact.py), bitwise equal to single-process
    training in float32 at world size 2, at a higher cost.

    The keyword-only options (``reshard_after_forward``, ``sync_module_states``,
    ``reduce_dtype``, ``cast_forward_inputs``, ``activation_checkpointing``, and
    ``device_mesh`` or ``shard_group`` with ``replicate_group`` for hybrid sharding) are those of
    torch's ``fully_shard``, with its defaults; options.py describes each. ``no_sync()``
    accumulates gradients without reducing.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 exact_gradients: bool = False, *, shard: str = "weights", units: UnitPolicy = None,
                 reshard_after_forward: bool = True, sync_module_states: bool = True,
                 reduce_dtype: torch.dtype | None = None, cast_forward_inputs: bool = True,
                 activation_checkpointing: bool = False, device_mesh: DeviceMesh | None = None,
                 shard_group: dist.ProcessGroup | None = None,
                 replicate_group: dist.ProcessGroup | None = None):
        if not isinstance(exact_gradients, bool):
            raise TypeError(f"exact_gradients must be True or False, got {exact_gradients!r}")
        options = FsdpOptions(reshard_after_forward, sync_module_states, reduce_dtype,
                              activation_checkpointing, device_mesh, shard_group, replicate_group,
                              cast_forward_inputs)
        options.validate(exact_gradients)
        if units is not None and shard != "all":
            raise ValueError("units= chooses the units of shard='all'; shard='weights' gathers each layer alone")
        select = unit_selector(units)
        layers = _validate(module, compute_dtype, shard, exact_gradients)
        super().__init__()
        self.add_module(_INNER, module)
        self.compute_dtype = compute_dtype
        self.exact_gradients = exact_gradients
        self.shard = shard
        self.options = options
        self.mode = "exact-gradients" if exact_gradients else "reduce-scatter"  # as results name it
        self.world_size = dist.get_world_size()
        shard_group, _ = options.groups()
        if options.shard_group is not None:
            options.grid()  # groups that form no 2-D grid are refused here, before any sharding
        if options.sync_module_states:
            self._broadcast_from_rank0([*module.parameters(), *module.buffers()])
        if options.activation_checkpointing:
            checkpoint_layers(module)
        if shard == "all":
            self.sharded_weights = shard_units(module, self.compute_dtype, shard_group, options, select)
            self.units = units_under(module)
        else:
            self.sharded_weights, self.units = self._shard_weights(layers, shard_group)
        install_state_dict_hooks(module, self.sharded_weights, options)  # torch's DCP helpers: checkpoint.py
        shards = {id(w.param) for w in self.sharded_weights}
        replicated = [p for p in module.parameters() if id(p) not in shards]
        if not options.sync_module_states and replicated:
            # Each rank keeps its slice of its own values, which makes one model; replicated
            # parameters would stay each rank's own for good: rank 0's are everyone's.
            self._broadcast_from_rank0(replicated)
        self._root = Root(self, self.units, replicated, options, compute_dtype, exact_gradients)
        self._schedule = self._root.schedule
        if shard == "all":
            adopt(self._root, module)
        if self.exact_gradients:
            exact = self._install_exact()
            self._schedule.replicated = [p for p in replicated if id(p) not in exact.params]
        self._root.hook_replicated()
        self.register_state_dict_post_hook(FullyShardedDataParallel._own_keys)

    @property
    def module(self) -> nn.Module:
        """The wrapped model; its parameters are the shards, under their own names."""
        return self._modules[_INNER]

    def _shard_weights(self, layers: list[tuple[str, nn.Module]],
                       group: dist.ProcessGroup | None) -> tuple[list[ShardedWeight], list]:
        """The handout's sharding: each Linear/Embedding weight, gathered around its layer."""
        weights: dict[int, ShardedWeight] = {}  # id(original Parameter) -> its ShardedWeight
        by_layer: dict[str, ShardedWeight] = {}
        for name, layer in layers:
            original = layer._parameters["weight"]
            if id(original) not in weights:  # a tied weight is sharded once
                weights[id(original)] = ShardedWeight(f"{name}.weight", original, self.compute_dtype, group)
            weight = by_layer[name] = weights[id(original)]
            layer._parameters["weight"] = weight.shard
            call = Call([(layer, "weight", weight)])
            layer.register_forward_pre_hook(lambda m, args, c=call: self._schedule.pre_forward(c))
            layer.register_forward_hook(lambda m, args, out, c=call: self._schedule.post_forward(c),
                                        always_call=True)
        # A block's weights are gathered and reduced together (unit.py).
        units = build_units(by_layer, unit_keys(self.module, list(by_layer)))
        return list(weights.values()), units

    def _install_exact(self) -> ExactGradients:
        """Hook every leaf module owning trainable parameters for exact-gradient mode."""
        by_shard = {id(w.shard): w for w in self.sharded_weights}
        layers = []
        for name, m in self.module.named_modules():
            owned = {n: p for n, p in m._parameters.items() if p is not None}
            if next(m.children(), None) is not None or not owned or not is_row_separable(m):
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
    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Every rank takes rank 0's values of ``tensors``, as DDP starts."""
        seen: set[int] = set()
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                dist.broadcast(tensor.data, src=0)

    def forward(self, *args, **kwargs):
        root = self._root
        args, kwargs = root.enter(args, kwargs)
        try:
            return self.module(*args, **kwargs)
        finally:
            root.exit()

    # -- the wrapped model's own names ---------------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, ""), param

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, ""), buffer

    def __getattr__(self, name: str):
        """Attributes of the wrapped model read through the wrapper (torch's helpers walk
        parameter names attribute by attribute)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if _INNER not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules[_INNER], name)

    @staticmethod
    def _own_keys(module: nn.Module, state: dict, prefix: str, metadata) -> None:
        """State-dict post-hook: the wrapped model's keys without our attribute's name, sharded
        weights whole (gathered: every rank calls it), as a DDP or FSDP1 user loads them into a
        plain model."""
        ours = [k for k in state if k.startswith(prefix + _PREFIX)]
        for key in ours:
            value = state.pop(key)
            state[prefix + key[len(prefix + _PREFIX):]] = (
                value.full_tensor() if isinstance(value, DTensor) else value
            )

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        # Keys come in the wrapped model's own names: route them to it under our attribute.
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
            state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- steps ---------------------------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do after a backward that ended: the schedule waited for every reduction
        and installed the shards' gradients as it ended. Kept for the adapters
        (``fsdp_on_after_backward``); a second call changes nothing."""
        self._root.finish()

    def no_sync(self):
        """Gradient accumulation: backward passes inside sum their full gradients locally and
        launch no reduction; the first backward after it reduce-scatters the sum of every
        micro-batch (one reduce-scatter per weight per step, as one large batch)."""
        return self._root.no_sync()

    def release(self) -> None:
        """Let go of this wrapper's communication state before ``destroy_process_group()``.

        Waits for every reduction and all-gather still in flight and drops their work handles
        and gathered buffers, so that none is left for gloo's worker threads to destroy during
        interpreter exit (cs336_systems/launch/lifetime.py). It holds no process group of its
        own. Shards, their gradients and the optimizer are untouched; a later forward gathers
        again.
        """
        self._schedule.release()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by its name in the module (a collective: all ranks call).

        Sharded weights are all-gathered in their master dtype; replicated ones are copied.
        """
        return self._root.gather_full_params(self.module)


def is_row_separable(module: nn.Module) -> bool:
    """Whether a leaf's output rows depend on its own input rows only, so its parameter
    gradients can be recomputed from gathered rows (exact.py). Batch norm in training mode
    normalises over the whole local batch: its parameters keep the all-reduce path."""
    return not isinstance(module, nn.modules.batchnorm._BatchNorm)
