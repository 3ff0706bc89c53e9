"""``FSDPModule``: the methods a module gains from our ``fully_shard``, with torch's names and meaning.

torch's ``fully_shard`` turns a module's class into one that also derives from its ``FSDPModule``;
ours does the same with this class (composable.py), so a script that calls these methods on torch's
sharded modules runs on ours:

=================================================  ===============================================
method (torch's signature)                         here
=================================================  ===============================================
``unshard(async_op=False)``                        one all-gather of the module's own unit(s), not
                                                   recursive; ``async_op=True`` returns a handle
                                                   whose ``wait()`` waits (its forward waits anyway)
``reshard()``                                      frees the module's gathered weights, not
                                                   recursive (a later backward gathers them again)
``set_reshard_after_forward(b, recurse=True)``     per module, as the ``fully_shard`` keyword; also
                                                   on the root, which otherwise keeps its weights
``set_reshard_after_backward(b, *, recurse=True)`` False: weights stay gathered after their
                                                   gradient, so the next forward gathers nothing
                                                   (call ``reshard()`` before the optimizer step,
                                                   as torch asks)
``set_modules_to_forward_prefetch(modules)``       after this module's gather, gather theirs (in
                                                   place of the next module's, our default)
``set_modules_to_backward_prefetch(modules)``      the same in backward, in place of the previous
``set_is_last_backward(b)``                        recorded; ours finishes every synchronised
                                                   backward's reductions before it returns, so
                                                   gradients are final whatever it says
``set_requires_gradient_sync(b, *, recurse=True)`` False: backward passes reduce nothing and sum
                                                   full gradients locally; for the whole model
                                                   (``recurse=False`` is refused)
=================================================  ===============================================

Beyond torch's, ``no_sync()`` (a context for the same), ``finish_gradient_synchronization()`` and
``gather_full_params()`` serve callers written for our wrapper, and ``release()`` drops every
collective in flight before the process group is destroyed.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from cs336_systems.fsdp.root import Root, root_of
from cs336_systems.fsdp.sharded_weight import ShardedWeight
from cs336_systems.fsdp.unit import Unit


class UnshardHandle:
    """An explicit unshard in flight (torch's ``UnshardHandle``): :meth:`wait` waits for it."""

    def __init__(self, weights: list[ShardedWeight]):
        self._weights = weights

    def wait(self) -> None:
        for weight in self._weights:
            weight.wait_gather()
        self._weights = []


def _units(module: nn.Module) -> list[Unit]:
    return module.__dict__["_fsdp_units"]


def _sharded(modules: Iterable[nn.Module], setter: str) -> list[nn.Module]:
    modules = list(modules)
    for m in modules:
        if "_fsdp_call" not in m.__dict__:
            raise TypeError(f"{setter} takes modules sharded by fully_shard; {type(m).__name__} is not")
    return modules


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _owner(module: nn.Module) -> Root | None:
    """The module's root, if a forward has made one (explicit gathers before it use no schedule)."""
    return module.__dict__.get("_fsdp_owner_root")


class FSDPModule:
    """The methods a module gains from :func:`fully_shard` (see the module docstring)."""

    def _fsdp_modules(self, recurse: bool) -> list[nn.Module]:
        assert isinstance(self, nn.Module)
        return [m for m in (self.modules() if recurse else [self]) if "_fsdp_call" in m.__dict__]

    # -- torch's FSDPModule ---------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        root = _owner(self)
        for unit in _units(self):
            if root is not None:
                root.schedule.gather_unit(unit)  # known to the schedule, which frees it after use
            else:
                unit.start_gather()
        handle = UnshardHandle([w for unit in _units(self) for w in unit.members])
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        root = _owner(self)
        for unit in _units(self):
            for weight in unit.members:
                if root is not None:
                    root.schedule.free(weight)
                else:
                    weight.free()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _check_bool("reshard_after_forward", reshard_after_forward)
        for m in self._fsdp_modules(recurse):
            m._fsdp_call.reshard = reshard_after_forward
            m.__dict__["_fsdp_reshard_set"] = True  # the lazy root keeps it (root.py)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _check_bool("reshard_after_backward", reshard_after_backward)
        for m in self._fsdp_modules(recurse):
            for unit in _units(m):
                unit.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        modules = _sharded(modules, "set_modules_to_forward_prefetch")
        self._fsdp_call.forward_prefetch = [u for m in modules for u in _units(m)]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        units = [u for m in _sharded(modules, "set_modules_to_backward_prefetch") for u in _units(m)]
        for unit in _units(self):
            unit.backward_prefetch = units

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _check_bool("is_last_backward", is_last_backward)
        self.__dict__["_fsdp_is_last_backward"] = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        if not recurse:
            raise ValueError("set_requires_gradient_sync(recurse=False) is not supported here: gradient sync is "
                             "switched for the whole sharded model; call it with recurse=True")
        root_of(self).schedule.sync = requires_gradient_sync

    # -- ours -----------------------------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do after a backward that ended (the schedule finished it); kept for
        callers written for the wrapper, such as the adapters."""
        root_of(self).finish()

    def no_sync(self):
        """Gradient accumulation: backward passes inside reduce nothing (as torch's
        ``set_requires_gradient_sync(False)``); the first backward after it reduces the sum."""
        return root_of(self).no_sync()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        return root_of(self).gather_full_params(self)

    def release(self) -> None:
        """Wait for and drop every collective in flight (before destroying the process group)."""
        root_of(self).schedule.release()
