"""torch's ``fully_shard`` keywords, read into ours, so that swapping the import is the whole port.

=========================  ===================================================================
torch's keyword            ours
=========================  ===================================================================
``mesh``                   a 1-D ``DeviceMesh``: shard over its group (``group=`` in ours); a
                           2-D (hybrid) mesh is refused: ``FullyShardedDataParallel`` takes it
``reshard_after_forward``  True / False as torch; None is torch's default (True); an int
                           (reshard to a smaller group) is refused
``mp_policy``              ``MixedPrecisionPolicy``: ``param_dtype`` is our ``compute_dtype``,
                           ``reduce_dtype`` and ``cast_forward_inputs`` ours, ``output_dtype``
                           casts the module's floating outputs, as torch's does
``offload_policy``         ``OffloadPolicy()`` (torch's default: nothing offloaded); a
                           ``CPUOffloadPolicy`` is refused: our shards stay on their device
``shard_placement_fn``,    only their defaults (None): every parameter is sharded on dim 0 and
``ignored_params``,        none is left out
``dp_mesh_dims``
=========================  ===================================================================

Each refusal is one line naming the keyword and its value, raised before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.fsdp.options import COMPUTE_DTYPES


@dataclass(frozen=True)
class ShardingKeywords:
    """What ``fully_shard``'s keywords, torch's or ours, come to."""

    compute_dtype: torch.dtype | None  # gather and compute in this dtype (None: the parameters')
    reduce_dtype: torch.dtype | None  # reduce gradients in this dtype (None: float32)
    output_dtype: torch.dtype | None  # cast the module's floating outputs to it (None: leave them)
    cast_forward_inputs: bool
    reshard_after_forward: bool
    group: dist.ProcessGroup | None  # the group to shard over (None: the world)


def _mesh_group(mesh: Any) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard(mesh=...) takes a 1-D DeviceMesh here, got {mesh.ndim}-D {mesh!r}: for hybrid "
            "sharding use FullyShardedDataParallel(model, shard='all', device_mesh=<2-D mesh>)"
        )
    return mesh.get_group()


def _refuse_unless_default(name: str, value: Any) -> None:
    if value is not None and not (name == "ignored_params" and len(value) == 0):
        raise ValueError(f"fully_shard({name}={value!r}) is not supported here: leave {name} at None")


def resolve(*, mesh: Any, reshard_after_forward: Any, mp_policy: Any, offload_policy: Any,
            compute_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, cast_forward_inputs: bool,
            group: dist.ProcessGroup | None, **unsupported: Any) -> ShardingKeywords:
    """torch's keywords and ours as one :class:`ShardingKeywords`; ValueError or TypeError,
    naming the value, for a keyword ours cannot honour or two that say the same thing."""
    for name, value in unsupported.items():
        _refuse_unless_default(name, value)
    if reshard_after_forward is None:
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r} "
            "(resharding to a smaller group after forward is not supported here)"
        )
    if offload_policy is not None:
        from torch.distributed.fsdp import OffloadPolicy

        if type(offload_policy) is not OffloadPolicy:
            raise ValueError(
                f"fully_shard(offload_policy={offload_policy!r}) is not supported here: shards stay on their "
                "parameters' device; leave offload_policy out"
            )
    output_dtype = None
    if mp_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
        if compute_dtype is not None or reduce_dtype is not None:
            raise ValueError(
                f"give mp_policy or compute_dtype/reduce_dtype, not both: got mp_policy={mp_policy!r}, "
                f"compute_dtype={compute_dtype!r}, reduce_dtype={reduce_dtype!r}"
            )
        _refuse_unless_default("mp_policy.param_dtype_override_fn", getattr(mp_policy, "param_dtype_override_fn", None))
        compute_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        output_dtype, cast_forward_inputs = mp_policy.output_dtype, mp_policy.cast_forward_inputs
    for name, dtype in (("compute_dtype (mp_policy.param_dtype)", compute_dtype),
                        ("output_dtype", output_dtype)):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"{name} must be one of None, torch.float32, torch.float16 or torch.bfloat16; got {dtype!r}"
            )
    if mesh is not None:
        if group is not None:
            raise ValueError(f"give mesh or group, not both: got mesh={mesh!r} and group={group!r}")
        group = _mesh_group(mesh)
    return ShardingKeywords(compute_dtype, reduce_dtype, output_dtype, cast_forward_inputs,
                            reshard_after_forward, group)
