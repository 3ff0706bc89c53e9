"""Checkpoints of our FSDP with torch's own tools: ``torch.distributed.checkpoint`` (DCP) and its
``state_dict`` helpers (``get_model_state_dict``, ``set_optimizer_state_dict``, ...).

Usage (every rank; ``model`` is a model sharded in place by our ``fully_shard``, or
``fsdp.module``, the wrapped model whose parameters are the shards, as ``fully_shard``'s model
is its own FSDP module; the wrapper itself gives whole tensors under the model's keys)::

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)                  # sharded: each rank writes its rows
    dcp.load(state, checkpoint_id=path)                  # at any world size
    set_model_state_dict(model, state["model"]); set_optimizer_state_dict(model, opt, state["optim"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # rank 0: plain_model.load_state_dict(full)

How. torch's helpers gather and distribute DTensors and pass every other tensor through, so a
shard must appear as a DTensor of the weight's own shape. With every parameter sharded and no
hybrid sharding, the module already holds one (sharded_weight.py): it and its optimizer state
are saved as they are, and loading turns a whole tensor (or a DTensor placed otherwise) into it.
With the handout's sharding, or hybrid sharding, a shard is a slice of the flattened, padded
weight, which no DTensor placement describes: a ``Shard(0)`` DTensor holds whole rows,
``torch.chunk``'s split. So there ``state_dict()`` all-gathers each weight (one at a
time; the full weight lives only while its rows are copied out) and yields this rank's rows as a
``Shard(0)`` DTensor on the FSDP group's mesh, which is the layout ``fully_shard`` uses; loading
takes a DTensor (gathered whole) or a whole tensor and cuts this rank's flat slice from it. The
same holds for the optimizer's shard-sized state (AdamW's moments). Consequences: a model's and
an optimizer's ``state_dict()`` are collectives, called by every rank in the same order (as FSDP's
sharded state dicts are in torch), and a checkpoint saved by ours loads into ``fully_shard`` and
the other way round. Replicated parameters stay plain tensors, equal on every rank; DCP writes
one copy.

Hybrid sharding (HSDP). Each weight is sharded within its shard group and the shard groups hold
copies, so its rows are placed ``(Replicate(), Shard(0))`` on the 2-D ("replicate", "shard")
mesh, as ``fully_shard(mesh=<2-D mesh>)`` places them: the wrapper's own ``device_mesh``, or with
``shard_group``/``replicate_group`` a mesh made from those groups by ``DeviceMesh.from_group``
(its layout gathered over the replicate group; the wrapper refuses groups that form no grid). DCP
writes each row block once, so a hybrid checkpoint loads at any world size, hybrid or not, into
ours or ``fully_shard``. ShardedWeight knows only its shard group: the wrapper hands its
options over with its weights (:func:`install_state_dict_hooks`).

Model hooks are installed by the wrapper and by ``fully_shard``, on every parameter slot holding
a shard (a Linear's ``weight``, a norm's ``bias``, ``in_proj_weight``); an optimizer's get theirs on its first ``step()``
(a global pre-step hook), which torch's ``get/set_optimizer_state_dict`` make themselves when the
optimizer has no state yet, or at once with :func:`enable_optimizer_checkpoints`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cs336_systems.fsdp.options import FsdpOptions
from cs336_systems.fsdp.sharded_weight import ShardedWeight

# id(shard Parameter) -> its ShardedWeight, for every live wrapper (an optimizer finds its
# shards here). Weak values: an entry goes when its ShardedWeight does.
_owners: weakref.WeakValueDictionary[int, ShardedWeight] = weakref.WeakValueDictionary()
_optimizers_seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_step_hook: torch.utils.hooks.RemovableHandle | None = None
# A hybrid wrapper's options, by the weights it shards.
_hybrid: weakref.WeakKeyDictionary[ShardedWeight, FsdpOptions] = weakref.WeakKeyDictionary()
# A hybrid wrapper's options -> its 2-D mesh per device type, made on its first checkpoint.
_meshes: weakref.WeakKeyDictionary[FsdpOptions, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def _hybrid_mesh(options: FsdpOptions, device_type: str) -> DeviceMesh:
    """The 2-D ("replicate", "shard") mesh of a hybrid wrapper, on ``device_type``: its own
    ``device_mesh`` when it has one of that type, else one made from its process groups and
    their grid (``FsdpOptions.grid``: the groups form has no layout tensor, a mesh needs one)."""
    if options.device_mesh is not None and options.device_mesh.device_type == device_type:
        return options.device_mesh
    shard_group, replicate_group = options.groups()
    assert shard_group is not None and replicate_group is not None
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=options.grid(),
                                 mesh_dim_names=("replicate", "shard"))


def _placement(weight: ShardedWeight, device: torch.device) -> tuple[DeviceMesh, list[Placement]]:
    """Where this rank's rows live, as ``fully_shard`` places them: ``Shard(0)`` on the FSDP
    group's 1-D mesh, or under hybrid sharding ``(Replicate(), Shard(0))`` on the 2-D mesh."""
    options = _hybrid.get(weight)
    if options is None:
        return DeviceMesh.from_group(weight.group or dist.group.WORLD, device.type), [Shard(0)]
    meshes = _meshes.setdefault(options, {})
    if device.type not in meshes:
        meshes[device.type] = _hybrid_mesh(options, device.type)
    return meshes[device.type], [Replicate(), Shard(0)]


def to_dtensor(weight: ShardedWeight, flat: torch.Tensor) -> DTensor:
    """A shard-shaped tensor (the shard itself, or optimizer state beside it) as this rank's rows
    of the whole weight-shaped tensor: a ``Shard(0)`` DTensor (``(Replicate(), Shard(0))`` under
    hybrid sharding). A collective over the FSDP group (the shard group).
    """
    layout = weight.layout
    padded = flat.new_empty(layout.padded_numel)
    dist.all_gather_into_tensor(padded, flat.detach().contiguous(), group=weight.group)
    full = layout.unflatten(padded)
    mesh, placements = _placement(weight, flat.device)
    # No communication (src_data_rank=None): every rank holds `full` and keeps its own chunk.
    rows = distribute_tensor(full, mesh, placements, src_data_rank=None)
    # Copied out, so that the gathered buffer is freed now rather than kept by a view.
    return DTensor.from_local(
        rows.to_local().clone(), rows.device_mesh, rows.placements, run_check=False,
        shape=rows.shape, stride=rows.stride(),
    )


def to_flat_shard(weight: ShardedWeight, value: Any, key: str) -> torch.Tensor:
    """This rank's part of a checkpointed weight-shaped value, as the module holds it (the flat
    slice, or a ``Shard(0)`` DTensor: ``ShardedWeight.from_full``): from a DTensor of any
    placement (gathered whole: a collective over its mesh; none when it is already placed as
    the module's is) or a whole tensor."""
    if weight.mesh is not None and isinstance(value, DTensor) and _placed_as_param(weight, value):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{key}: expected a tensor for an FSDP-sharded weight, got {type(value).__name__}")
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if full.shape != weight.layout.shape:
        raise ValueError(
            f"{key}: the checkpoint holds shape {tuple(full.shape)}, the FSDP-sharded weight is "
            f"{tuple(weight.layout.shape)}; load the whole weight or a DTensor of it (what "
            "get_model_state_dict/get_optimizer_state_dict return), not a rank's flat shard"
        )
    return weight.from_full(full)


def _placed_as_param(weight: ShardedWeight, value: DTensor) -> bool:
    param = weight.param
    return (value.device_mesh == param.device_mesh and value.placements == param.placements
            and value.shape == param.shape)


# -- the model: state_dict() yields DTensors, load_state_dict() takes DTensors or whole weights --

def _save_rows(weight: ShardedWeight, name: str, module: nn.Module, state_dict: dict, prefix: str,
               metadata) -> None:
    key = f"{prefix}{name}"
    if key in state_dict and weight.mesh is None:  # a DTensor parameter is saved as it is
        state_dict[key] = to_dtensor(weight, state_dict[key])


def _load_rows(weight: ShardedWeight, name: str, module: nn.Module, state_dict: dict, prefix: str,
               *rest) -> None:
    key = f"{prefix}{name}"
    if key in state_dict:
        state_dict[key] = to_flat_shard(weight, state_dict[key], key)


def install_state_dict_hooks(module: nn.Module, sharded_weights: list[ShardedWeight],
                             options: FsdpOptions) -> None:
    """Hook every parameter slot holding one of ``sharded_weights`` (tied ones in each of their
    modules; a slot once, however many wrappers or ``fully_shard`` calls see it), and make
    optimizers over them hook themselves on their first step."""
    global _step_hook
    by_shard = {id(w.param): w for w in sharded_weights}
    if options.is_hybrid:
        _hybrid.update(dict.fromkeys(sharded_weights, options))
    for layer in module.modules():
        hooked = layer.__dict__.setdefault("_fsdp_hooked_slots", set())
        for name, param in layer._parameters.items():
            weight = by_shard.get(id(param))
            if weight is None or name in hooked:
                continue
            hooked.add(name)
            # partial, not a bound method: register_state_dict_post_hook marks its hook object.
            layer.register_state_dict_post_hook(functools.partial(_save_rows, weight, name))
            layer.register_load_state_dict_pre_hook(functools.partial(_load_rows, weight, name))
    _owners.update(by_shard)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_on_optimizer_step)


# -- the optimizer: shard-sized state as DTensors, keyed as torch's helpers key it -------------

def _params_by_key(optimizer: torch.optim.Optimizer, state_dict: dict) -> list[tuple[Any, nn.Parameter]]:
    """(key in ``state_dict``, parameter) pairs: a state dict's groups list its parameters' keys
    (indices, or FQNs from torch's helpers) in the optimizer's own order."""
    keys = [k for group in state_dict["param_groups"] for k in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(keys) != len(params):
        raise ValueError(
            f"optimizer state dict lists {len(keys)} parameters, the optimizer has {len(params)}"
        )
    return list(zip(keys, params))


def _is_shard_state(weight: ShardedWeight, value: Any) -> bool:
    """A flat shard's state (a DTensor parameter's state is a DTensor already)."""
    return weight.mesh is None and type(value) is torch.Tensor and value.shape == weight.shard.shape


def _is_weight_state(weight: ShardedWeight, value: Any) -> bool:
    return isinstance(value, DTensor) or (
        isinstance(value, torch.Tensor) and value.shape == weight.layout.shape and value.dim() > 0
    )


def _optimizer_state_to_rows(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """State-dict post-hook: each shard-sized state tensor becomes the weight's rows (DTensor)."""
    state = dict(state_dict["state"])  # new per-parameter dicts: the optimizer's own stay as they are
    for key, param in _params_by_key(optimizer, state_dict):
        weight = _owners.get(id(param))
        if weight is not None and key in state:
            state[key] = {
                name: to_dtensor(weight, v) if _is_shard_state(weight, v) else v
                for name, v in state[key].items()
            }
    return {**state_dict, "state": state}


def _optimizer_state_to_shards(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Load pre-hook: DTensor or whole weight-shaped state becomes this rank's flat slice."""
    state = dict(state_dict["state"])
    for key, param in _params_by_key(optimizer, state_dict):
        weight = _owners.get(id(param))
        if weight is not None and key in state:
            state[key] = {
                name: to_flat_shard(weight, v, f"optimizer state {name} of {key}")
                if _is_weight_state(weight, v) else v
                for name, v in state[key].items()
            }
    return {**state_dict, "state": state}


def enable_optimizer_checkpoints(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the hooks above if it steps any FSDP shard (once; idempotent)."""
    if optimizer in _optimizers_seen:
        return
    _optimizers_seen.add(optimizer)
    if any(id(p) in _owners for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_optimizer_state_to_rows)
        optimizer.register_load_state_dict_pre_hook(_optimizer_state_to_shards)


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    enable_optimizer_checkpoints(optimizer)
