"""torch's ``DistributedDataParallel`` keywords, read into our wrappers', so a torch script ports
with its import changed.

Every variant takes these, as keywords (torch's positional order differs from ours):

===============================  ==============================================================
torch's keyword                  ours
===============================  ==============================================================
``process_group``,               the group to reduce over; a 1-D ``DeviceMesh``'s group; not both
``device_mesh``
``device_ids``, ``output_device``  None, or the one device the module's parameters are on (ours
                                 never move a module or its outputs)
``dim``                          0 (the sampler shards the batch; ours split none)
``broadcast_buffers``,           whether rank 0's buffers are broadcast at a forward's start
``forward_sync_buffers``         (torch 2.13 renamed the first to the second; default True)
``init_sync``                    True: broadcast rank 0's parameters and buffers at construction;
                                 False: trust that every rank built the same ones (torch's warning)
``find_unused_parameters``       True: a parameter without a gradient is fine (reduced from the
                                 ranks that used it; ``None`` where none did). False: the next
                                 forward raises, naming it, as torch's does. None (ours, the
                                 default): tolerated as True, at no cost (base.py says why)
``static_graph``                 True tolerates unused parameters as torch's does (it learns
                                 them in the first step); the ready order is learnt either way
``check_reduction``              accepted and ignored, as torch (deprecated there)
``bucket_cap_mb``                ``BucketedDDP``'s bucket cap (its ``bucket_size_mb``); refused by
                                 the variants without buckets
``gradient_as_bucket_view``      ``BucketedDDP``'s; refused as True elsewhere
===============================  ==============================================================

Refused unless left at torch's default, each in one line saying why: ``mixed_precision``,
``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, ``bucket_cap_mb_list``,
``skip_all_reduce_unused_params``, ``batched_grad_copy``, ``lazy_bucket_allocation``. Every
check runs before any collective, so a refused keyword fails on its own rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

# torch's keywords ours cannot honour: the value torch defaults to, and why another is refused.
_REFUSED: dict[str, tuple[Any, str]] = {
    "mixed_precision": (None, "communicate in another dtype with BucketedDDP(comm_dtype=...), or use autocast"),
    "delay_all_reduce_named_params": (None, "ours cannot leave chosen parameters out of the overlap"),
    "param_to_hook_all_reduce": (None, "ours have no all-reduce hook on a chosen parameter"),
    "bucket_cap_mb_list": (None, "BucketedDDP takes one cap (bucket_cap_mb) and first_bucket_mb"),
    "skip_all_reduce_unused_params": (False, "ours always reduce a gradient some rank produced"),
    "batched_grad_copy": (False, "ours copy gradients into buckets as each is ready"),
    "lazy_bucket_allocation": (False, "ours allocate their buckets at construction"),
}
_NO_BUCKETS = ("bucket_cap_mb", "gradient_as_bucket_view")


@dataclass(frozen=True)
class DDPKeywords:
    """What torch's keywords come to for one wrapper."""

    process_group: dist.ProcessGroup | None
    broadcast_buffers: bool  # broadcast rank 0's buffers at the start of a synchronised forward
    init_sync: bool  # broadcast rank 0's parameters and buffers at construction
    refuse_unused: bool  # a synchronised parameter without a gradient raises at the next forward


def _check_bool(name: str, value: Any, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        expected = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"{name} must be {expected}, got {value!r}")


def _check_devices(wrapper: str, params: Sequence[nn.Parameter], device_ids: Any, output_device: Any) -> None:
    device = params[0].device
    if device_ids is not None:
        ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else None
        if ids is None or len(ids) != 1 or _as_device(ids[0], device) != device:
            raise ValueError(
                f"{wrapper}(device_ids={device_ids!r}): ours take None or the one device the module's "
                f"parameters are on ([{device}]); move the module to its rank's device before wrapping"
            )
    if output_device is not None and _as_device(output_device, device) != device:
        raise ValueError(f"{wrapper}(output_device={output_device!r}): outputs stay on the module's device "
                         f"({device}); leave output_device at None")


def _as_device(value: Any, like: torch.device) -> torch.device:
    """torch's reading of a device id: an int is an index on the parameters' device type."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device(like.type, value)
    return torch.device(value)


def resolve(wrapper: str, params: Sequence[nn.Parameter], process_group: dist.ProcessGroup | None, *,
            buckets: bool, device_ids: Any = None, output_device: Any = None, dim: int = 0,
            broadcast_buffers: bool | None = None, forward_sync_buffers: bool | None = None,
            init_sync: bool = True, find_unused_parameters: bool | None = None, static_graph: bool = False,
            check_reduction: bool = False, device_mesh: Any = None, **others: Any) -> DDPKeywords:
    """torch's keywords for ``wrapper`` (its class name) as :class:`DDPKeywords`; TypeError or
    ValueError naming the keyword for one it cannot honour. ``buckets``: the wrapper takes
    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` itself (they are refused here otherwise)."""
    for name, value in others.items():
        if name in _NO_BUCKETS and not buckets:
            if value is None or value is False:
                continue
            raise ValueError(f"{wrapper} has no buckets, so it takes no {name}={value!r}: "
                             "BucketedDDP does")
        if name not in _REFUSED:
            raise TypeError(f"{wrapper} got an unexpected keyword argument {name!r} (neither ours nor "
                            "torch's DistributedDataParallel's)")
        default, why = _REFUSED[name]
        if value != default:
            raise ValueError(f"{wrapper} does not support torch DDP's {name}={value!r}: {why}")
    for name, value in (("init_sync", init_sync), ("static_graph", static_graph),
                        ("check_reduction", check_reduction)):
        _check_bool(name, value)
    for name, value in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers),
                        ("find_unused_parameters", find_unused_parameters)):
        _check_bool(name, value, allow_none=True)
    if dim != 0:
        raise ValueError(f"{wrapper}(dim={dim!r}): ours split no batch (each rank brings its own shard); leave dim=0")
    _check_devices(wrapper, params, device_ids, output_device)
    if device_mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise ValueError(f"{wrapper}(device_mesh={device_mesh!r}) takes a 1-D DeviceMesh")
        if process_group is not None:
            raise ValueError(f"give {wrapper} process_group or device_mesh, not both")
        process_group = device_mesh.get_group()
    # forward_sync_buffers is torch 2.13's name for broadcast_buffers and wins over it, as in torch.
    forward_sync = forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers
    return DDPKeywords(process_group, forward_sync is not False, init_sync,
                       refuse_unused=find_unused_parameters is False and not static_graph)
