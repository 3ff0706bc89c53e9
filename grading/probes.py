"""What the suite observes inside a rank beyond the values a submission computes.

* ``CollectiveLog`` wraps torch.distributed's collectives (installed before the submission is
  imported, so ``from torch.distributed import all_reduce`` gets the wrapped one too) and records
  each call, and whether backward was still running when it was issued.
* ``BackwardProbe`` is an identity layer whose backward marks the moment the gradients of every
  layer above it are done and only the layers below remain: a collective logged before that
  moment overlapped backward.
* ``tensor_bytes_reachable`` sums the storage bytes an object holds, however it nests them.
"""

from __future__ import annotations

import gc
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced",
              "_reduce_scatter_base")
OTHERS = ("broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object",
          "broadcast_object_list", "scatter", "gather", "all_to_all", "all_to_all_single")


@dataclass
class CollectiveLog:
    calls: list[tuple[str, bool]] = field(default_factory=list)  # (name, issued while backward ran)
    in_backward: bool = False
    paused: bool = False  # the suite's own collectives are not the submission's

    def reductions(self, since: int = 0) -> int:
        return sum(name in REDUCTIONS for name, _ in self.calls[since:])

    def reductions_during_backward(self, since: int = 0) -> int:
        return sum(name in REDUCTIONS and during for name, during in self.calls[since:])


LOG = CollectiveLog()


def _wrapped(name: str, original):
    def collective(*args, **kwargs):
        if not LOG.paused:
            LOG.calls.append((name, LOG.in_backward))
        return original(*args, **kwargs)

    collective.__wrapped__ = original
    collective.__name__ = name
    collective.grading_logged = True
    return collective


def install_collective_log() -> None:
    """Wrap every collective of torch.distributed (and of distributed_c10d, where it lives)."""
    from torch.distributed import distributed_c10d

    for name in REDUCTIONS + OTHERS:
        for namespace in (dist, distributed_c10d):
            original = getattr(namespace, name, None)
            if original is not None and not getattr(original, "grading_logged", False):
                setattr(namespace, name, _wrapped(name, original))


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        LOG.in_backward = False  # every layer above the probe is done; the ones below remain
        return grad


class BackwardProbe(torch.nn.Module):
    """Identity; backward is "running" from the loss until this layer's backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x)


def mark_backward_start() -> None:
    LOG.in_backward = True


def tensor_bytes_reachable(root: object, exclude: set[int] = frozenset()) -> int:
    """Bytes of every distinct tensor storage reachable from ``root``, except storages whose
    data pointer is in ``exclude``. Follows containers, instance attributes, modules' parameter,
    buffer and submodule tables, tensor attributes and closures; not modules or globals."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    skip = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool)
    while stack and len(seen) < 500_000:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                if storage.data_ptr() not in exclude:
                    storages[storage.data_ptr()] = storage.nbytes()
            stack.extend(getattr(obj, "__dict__", {}).values())
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in (obj.__closure__ or ()) if _filled(c))
            continue
        if isinstance(obj, (dict, list, tuple, set, frozenset, types.MethodType)) or hasattr(obj, "__dict__") \
                or hasattr(type(obj), "__slots__"):
            stack.extend(r for r in gc.get_referents(obj) if not isinstance(r, types.FrameType))
    return sum(storages.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
