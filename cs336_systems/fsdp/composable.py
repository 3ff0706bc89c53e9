"""Every parameter sharded, unit by unit: ``fully_shard`` in place, as torch's FSDP2 applies it.

Usage (every rank), as every FSDP2 recipe writes it::

    for block in model.layers:
        fully_shard(block)                      # a unit: one all-gather, one reduce-scatter
    fully_shard(model)                          # the root: every parameter not in a block
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward()             # gradients reduced when backward ends
    optimizer.step()

A call shards every parameter of the module's subtree that no earlier call (a nested unit)
sharded: each becomes a 1-D shard in its place (sharded_weight.py), whatever module owns it.
The module's forward pre-hook puts every full parameter of its unit back in its slot, whoever
reads it: a Linear's ``weight`` as much as ``nn.MultiheadAttention``'s ``in_proj_weight``,
which it reads without calling a Linear; its forward hook puts the shards back. So the unit is
gathered before its forward, freed after it, and gathered again for backward when autograd
needs what it saved (schedule.py). The outermost unit whose forward runs first is the root
(lazily, as torch decides): its schedule drives every unit under it, and it keeps its own
parameters gathered from forward to backward, as torch's root does.

The module stays itself (its class gains ``FSDPModule``'s methods, module_api.py, as torch's does), so its
``state_dict()`` keys are its own and torch's ``get_model_state_dict(model)`` works on it;
sharded parameters appear as ``Shard(0)`` DTensors (checkpoint.py).

``FullyShardedDataParallel(model, shard="all")`` does the same behind the wrapper: each
element of every ``nn.ModuleList`` a unit, then the model.

torch.compile: ``torch.compile(model)`` of a sharded model works. The hooks (here, root.py and
schedule.py's forward hooks and saved-tensor hooks) are ``torch.compiler.disable``d: they swap
tensors into modules' ``_parameters`` and run collectives, which dynamo would otherwise guard
on and recompile for until its recompile limit. Dynamo compiles the computation between them;
tests/test_fsdp_any_module.py trains a compiled model (``fail_on_recompile_limit_hit``) to
the eager model's weights. The cost in eager mode: about a microsecond per hook call.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cs336_systems.fsdp.checkpoint import install_state_dict_hooks
from cs336_systems.fsdp.options import FsdpOptions
from cs336_systems.fsdp.module_api import FSDPModule
from cs336_systems.fsdp.root import Root, cast_floats, root_of, units_under
from cs336_systems.fsdp.sharded_weight import ShardedWeight
from cs336_systems.fsdp.torch_keywords import resolve
from cs336_systems.fsdp.unit import Call, Unit

if TYPE_CHECKING:  # torch's types, for the signature only
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy


def shard_unit(module: nn.Module, compute_dtype: torch.dtype | None,
               group: dist.ProcessGroup | None, as_dtensors: bool = True) -> Call:
    """Shard every parameter of ``module``'s subtree outside nested units; returns its call.

    ``as_dtensors``: the module holds each as a ``Shard(0)`` DTensor of its own shape, as under
    torch's ``fully_shard`` (sharded_weight.py); False (hybrid sharding): the flat shard.
    A parameter tied to one a nested unit sharded (the same ``nn.Parameter`` in two places) is
    not sharded again: this unit's slot holds the nested unit's weight, gathered with it.
    """
    nested = [m for m in module.modules() if m is not module and "_fsdp_call" in m.__dict__]
    inside = {id(x) for m in nested for x in m.modules()}
    known = {id(w.param): w for m in nested for unit in m._fsdp_units for w in unit.members}
    mesh = None
    if as_dtensors and any(True for _ in module.parameters()):
        device = next(module.parameters()).device
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    made: dict[int, ShardedWeight] = {}
    slots: list[tuple[nn.Module, str, ShardedWeight]] = []
    for owner_name, owner in module.named_modules():
        if id(owner) in inside:
            continue
        for name, param in owner._parameters.items():
            if param is None:
                continue
            weight = known.get(id(param)) or made.get(id(param))
            if weight is None:
                if not param.is_floating_point():
                    raise ValueError(
                        f"{owner_name or type(module).__name__}.{name} has dtype {param.dtype}; "
                        "FSDP shards floating parameters only"
                    )
                full_name = f"{owner_name}.{name}" if owner_name else name
                weight = made[id(param)] = ShardedWeight(full_name, param, compute_dtype, group, mesh)
            slots.append((owner, name, weight))
    for owner, name, weight in slots:
        owner._parameters[name] = weight.param
    by_dtype: dict[torch.dtype, list[ShardedWeight]] = {}
    for weight in made.values():  # a unit gathers one dtype: split one that mixes them
        by_dtype.setdefault(weight.compute_dtype, []).append(weight)
    units = [Unit(type(module).__name__, members) for members in by_dtype.values()]
    for unit in units:
        for weight in unit.members:
            weight.unit = unit
    module.__dict__["_fsdp_units"] = units
    call = module.__dict__["_fsdp_call"] = Call(slots)
    return call


@torch.compiler.disable
def _pre_forward(module: nn.Module, args: tuple, kwargs: dict):
    root = Root.active or root_of(module)
    if Root.active is None and root.module is module:  # the root's own forward
        args, kwargs = root.enter(args, kwargs)
    # Otherwise a unit inside the root's forward, or run outside it: rerun by activation
    # checkpointing in backward (or called on its own), its weights gathered all the same.
    dtype = module.__dict__["_fsdp_compute_dtype"]
    if module.__dict__["_fsdp_options"].cast_forward_inputs:
        args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
    root.schedule.pre_forward(module._fsdp_call)
    return args, kwargs


@torch.compiler.disable
def _post_forward(module: nn.Module, args: tuple, output):
    root = Root.active or module.__dict__.get("_fsdp_owner_root")
    if root is None:
        return None
    root.schedule.post_forward(module._fsdp_call)
    if Root.active is root and root.module is module:
        root.exit()
    return cast_floats(output, module.__dict__.get("_fsdp_output_dtype"))


# Which modules are units under the wrapper's shard="all": module classes (Lightning's
# auto_wrap_policy spelling) or a predicate; None: the elements of every nn.ModuleList.
UnitPolicy = Union[set, frozenset, list, tuple, Callable[[nn.Module], bool], None]


def unit_selector(units: UnitPolicy) -> Callable[[nn.Module], bool] | None:
    """The predicate ``units`` stands for (None stays None: the default units)."""
    if units is None or callable(units):
        return units
    classes = tuple(units)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"units must be module classes or a predicate on modules, got {units!r}")
    return lambda m: isinstance(m, classes)


def shard_units(module: nn.Module, compute_dtype: torch.dtype | None, group: dist.ProcessGroup | None,
                options: FsdpOptions, select: Callable[[nn.Module], bool] | None) -> list[ShardedWeight]:
    """The wrapper's ``shard="all"``: each module ``select`` picks (default: each element of
    every nn.ModuleList) a unit, innermost first, then the model, each gathered by its
    module's forward hooks, as ``fully_shard`` per unit then at the root."""
    if select is None:
        elements = [m for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    else:
        elements = [m for m in module.modules() if m is not module and select(m)]
    depth = {id(m): len(n.split(".")) for n, m in module.named_modules()}
    for m in sorted(elements, key=lambda m: -depth[id(m)]):
        if "_fsdp_call" not in m.__dict__ and any(True for _ in m.parameters()):
            shard_unit(m, compute_dtype, group, not options.is_hybrid)
    call = shard_unit(module, compute_dtype, group, not options.is_hybrid)
    call.reshard = False  # the outermost unit's parameters stay until backward, as torch's root
    for m in module.modules():
        if "_fsdp_call" in m.__dict__:
            m.__dict__["_fsdp_options"] = options
            m.__dict__["_fsdp_compute_dtype"] = compute_dtype
            m.register_forward_pre_hook(_pre_forward, with_kwargs=True)
            m.register_forward_hook(_post_forward, always_call=True)
            _hook_recomputation(m)
    return [w for unit in units_under(module) for w in unit.members]


def _hook_recomputation(module: nn.Module) -> None:
    """A unit rerun by activation checkpointing (activation_checkpointing.py) reruns its
    ``forward`` only: these gather and put back its parameters around the rerun."""
    module.__dict__["_fsdp_recompute_hooks"] = (functools.partial(_pre_forward, module, (), {}),
                                                functools.partial(_post_forward, module, (), None))


_classes: dict[type, type] = {}


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | None = True,
                shard_placement_fn: None = None, mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None, ignored_params: None = None,
                dp_mesh_dims: None = None, compute_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, cast_forward_inputs: bool = True,
                group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``module``'s parameters in place (those no nested call sharded) and return it.

    torch's keywords (``mesh``, ``reshard_after_forward``, ``mp_policy``, ``offload_policy``,
    ...) mean what they mean in torch's ``fully_shard``, or are refused in one line
    (torch_keywords.py). Ours, older: ``compute_dtype`` and ``reduce_dtype`` are
    ``MixedPrecisionPolicy``'s ``param_dtype`` and ``reduce_dtype``, ``cast_forward_inputs`` its
    flag, ``group`` the process group to shard over (None: the world; ``mesh``'s group).
    Each rank keeps its slice of its own values, as torch does: initialise every rank alike.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if "_fsdp_call" in module.__dict__:
        raise ValueError(f"{type(module).__name__} was already sharded by fully_shard")
    keywords = resolve(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                       offload_policy=offload_policy, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                       cast_forward_inputs=cast_forward_inputs, group=group, shard_placement_fn=shard_placement_fn,
                       ignored_params=ignored_params, dp_mesh_dims=dp_mesh_dims)
    compute_dtype, group = keywords.compute_dtype, keywords.group
    options = FsdpOptions(reshard_after_forward=keywords.reshard_after_forward, reduce_dtype=keywords.reduce_dtype,
                          sync_module_states=False, cast_forward_inputs=keywords.cast_forward_inputs)
    options.validate(exact_gradients=False)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialised default process group: call "
            "torch.distributed.init_process_group (or cs336_systems.launch.launch) first"
        )
    shard_unit(module, compute_dtype, group).reshard = keywords.reshard_after_forward
    module.__dict__["_fsdp_options"] = options
    module.__dict__["_fsdp_compute_dtype"] = compute_dtype
    module.__dict__["_fsdp_output_dtype"] = keywords.output_dtype
    install_state_dict_hooks(module, [w for u in module._fsdp_units for w in u.members], options)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=True)
    _hook_recomputation(module)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        if cls not in _classes:
            _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _classes[cls]
    return module
