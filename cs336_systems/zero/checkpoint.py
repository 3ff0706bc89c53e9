"""The sharded optimizer's state dicts: one shard per rank, or the whole state in torch's format.

Two formats. A *shard* (:func:`shard_state_dict`) is what one rank holds: its local optimizer's
state dict, tagged with :data:`STATE_DICT_FORMAT` and with how the parameters were cut, so that
loading it into a differently built optimizer fails with a message instead of silently mixing
up parameters. The *consolidated* state (:func:`consolidated_state_dict`) is the state dict an
unsharded optimizer over the same parameters would give, gathered from every rank: it loads
into a plain ``torch.optim`` optimizer, or into a ShardedOptimizer of any world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from cs336_systems.zero.optimizer import ShardedOptimizer

STATE_DICT_FORMAT = "cs336_systems.ShardedOptimizer/1"  # tags shard_state_dict() output

# Keys of a param group that are not hyperparameters: the local optimizer's groups hold only
# the owned subset of these.
PARAM_KEYS = ("params", "param_names")


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside it moved to the CPU (for pickling between ranks)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def shard_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """This rank's shard: the local optimizer's state dict plus how the shards were cut."""
    return {
        "format": STATE_DICT_FORMAT,
        "world_size": optimizer.world_size,
        "rank": optimizer.rank,
        "owners": list(optimizer.owners),
        "shard": optimizer.local_optimizer.state_dict(),
    }


def check_shard_state_dict(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """ValueError unless ``state_dict`` is this rank's shard of an identically sharded optimizer."""
    if state_dict.get("format") != STATE_DICT_FORMAT:
        raise ValueError(
            f"not a ShardedOptimizer.state_dict() (format {state_dict.get('format')!r}, "
            f"expected {STATE_DICT_FORMAT!r}); for a torch-format state dict of the whole "
            "optimizer use load_consolidated_state_dict()"
        )
    if state_dict["world_size"] != optimizer.world_size:
        raise ValueError(
            f"state dict was saved with world size {state_dict['world_size']}, but this job "
            f"has world size {optimizer.world_size}; save with consolidated_state_dict() and load "
            "with load_consolidated_state_dict() to change the world size"
        )
    if state_dict["rank"] != optimizer.rank:
        raise ValueError(
            f"state dict holds the shard of rank {state_dict['rank']}, but this is rank "
            f"{optimizer.rank}: each rank must load its own shard"
        )
    if list(state_dict["owners"]) != optimizer.owners:
        raise ValueError(
            f"state dict assigns {len(state_dict['owners'])} parameters to ranks differently "
            f"from this optimizer ({len(optimizer.owners)} parameters): were the parameters or "
            "param groups built differently?"
        )


def consolidated_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The whole optimizer's state in torch's format, on every rank (tensors on the CPU).

    A collective. The local optimizer numbers its parameters in the order it holds them (the
    owned ones, in param_groups order); here they get the numbers of the unsharded optimizer.
    """
    shards: list[Any] = [None] * optimizer.world_size
    dist.all_gather_object(shards, _to_cpu(optimizer.local_optimizer.state_dict()))
    state: dict[int, Any] = {}
    for rank, shard in enumerate(shards):
        global_index = optimizer.owned_indices(rank)
        for local_index, param_state in shard["state"].items():
            state[global_index[local_index]] = param_state
    param_groups = []
    start = 0
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        param_groups.append(packed)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def local_shard_of(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of a torch-format state dict of the whole optimizer, numbered as the
    local optimizer numbers its parameters; ValueError if the param groups do not match."""
    saved_groups = state_dict["param_groups"]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"state dict has param groups of sizes {saved_sizes}, but this optimizer has {sizes}"
        )
    saved_ids = [i for g in saved_groups for i in g["params"]]
    local_state: dict[int, Any] = {}
    local_groups = []
    start = 0
    for saved_group, size in zip(saved_groups, sizes):
        mine = [i for i in range(size) if optimizer.owners[start + i] == optimizer.rank]
        local_group = {k: v for k, v in saved_group.items() if k not in PARAM_KEYS}
        local_group["params"] = list(range(len(local_state), len(local_state) + len(mine)))
        if "param_names" in saved_group:
            local_group["param_names"] = [saved_group["param_names"][i] for i in mine]
        for local_index, i in zip(local_group["params"], mine):
            local_state[local_index] = state_dict["state"].get(saved_ids[start + i])
        local_groups.append(local_group)
        start += size
    return {
        "state": {k: v for k, v in local_state.items() if v is not None},
        "param_groups": local_groups,
    }
