"""Counting one step: live tensor bytes (and what they are at the peak) and collective bytes.

A ``TorchDispatchMode`` sees every tensor operation of the step on this thread (on a CPU,
autograd runs backward on the calling thread), c10d's collectives included. It keeps a weak
reference to the storage of every tensor an operation returns, plus the configuration's
resident tensors (parameters, buffers, optimizer state, and the last step's gradients where
something still holds them, as DDP's buckets do), and after each operation sums the bytes of
the storages still alive. Storages are summed anew each time rather than tracked by
allocation, because both FSDPs free a gathered weight by shrinking its storage in place, which
no operation reports. At each new peak the live storages are sorted into parameters
(registered parameters and buffers, every all-gather's output: gathered weights, and the
buffers of broadcasts: ZeRO-1's updated parameters), gradients (``.grad`` and the buffers of
reduce-scatters and all-reduces), optimizer state, and
the rest: activations, tensors autograd saved, temporaries.

Only this configuration's tensors are counted, though other configurations' models live in the
same process. The counting slows the step several times over; the timed steps run without it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cs336_systems.bench.fsdp.configurations import Configuration
from cs336_systems.bench.fsdp.record import ALL_GATHER, ALL_REDUCE, BROADCAST, MEMORY_PARTS, REDUCE_SCATTER

# c10d operation -> (collective kind, index of the argument holding the full-size buffers).
COLLECTIVE_OPS = {
    "_allgather_base_": (ALL_GATHER, 0),
    "allgather_": (ALL_GATHER, 0),
    "allgather_into_tensor_coalesced_": (ALL_GATHER, 0),
    "_reduce_scatter_base_": (REDUCE_SCATTER, 1),
    "reduce_scatter_": (REDUCE_SCATTER, 1),
    "reduce_scatter_tensor_coalesced_": (REDUCE_SCATTER, 1),
    "allreduce_": (ALL_REDUCE, 0),
    "allreduce_coalesced_": (ALL_REDUCE, 0),
    "broadcast_": (BROADCAST, 0),
}
# What a collective's buffers hold: gathered weights, gradients, or (ZeRO-1's broadcasts)
# updated parameters packed for sending.
_PART_OF_COLLECTIVE = {ALL_GATHER: "parameters", REDUCE_SCATTER: "gradients", ALL_REDUCE: "gradients",
                       BROADCAST: "parameters"}


def collective(func, args) -> tuple[str, list[torch.Tensor]] | None:
    """(kind, the full-size tensors) if ``func`` is a c10d collective we count, else None."""
    if func.namespace != "c10d":
        return None
    found = COLLECTIVE_OPS.get(func._opname)
    if found is None:
        return None
    kind, index = found
    return kind, [t for t in tree_leaves(args[index]) if isinstance(t, torch.Tensor)]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage(t) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
    if not isinstance(local, torch.Tensor) or local.device.type == "meta":
        return None
    try:
        return local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (some subclasses)
        return None


def resident_tensors(config: Configuration) -> dict[str, list[torch.Tensor]]:
    """This configuration's tensors outside any step, by part (gradients: those set now)."""
    params = [*config.model.parameters(), *config.model.buffers(), *config.module.parameters()]
    state = [t for s in config.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": params,
        # Leaves only: a layer's gathered weight sits among the parameters during its call.
        "gradients": [p.grad for p in params if p.is_leaf and p.grad is not None],
        "optimizer_state": state,
    }


class StepAccounting(TorchDispatchMode):
    """Peak live bytes of one step (and their split), and the step's collectives by kind."""

    def __init__(self, config: Configuration):
        super().__init__()
        self.config = config
        self._live: dict[int, weakref.ref] = {}
        self._marked: dict[int, str] = {}  # storage id -> part, from the collective it served
        # The last step's gradients count while something holds them: FSDP's are freed by the
        # step's zero_grad, DDP's buckets keep theirs.
        for part, tensors in resident_tensors(config).items():
            for t in tensors:
                self._track(t, part)
        self.resident_bytes = self._total()
        self.peak_bytes = self.resident_bytes
        self.peak_parts = self._split()
        self.payload_bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _track(self, tensor, part: str | None = None) -> None:
        storage = _storage(tensor)
        if storage is None:
            return
        key = id(storage)
        if key not in self._live:
            self._live[key] = weakref.ref(storage, lambda _, k=key: self._forget(k))
        if part is not None:
            self._marked[key] = part

    def _forget(self, key: int) -> None:
        self._live.pop(key, None)
        self._marked.pop(key, None)

    def _total(self) -> int:
        return sum(s.nbytes() for ref in list(self._live.values()) if (s := ref()) is not None)

    def _split(self) -> dict[str, int]:
        """The live bytes by part, parts as they are now."""
        now = resident_tensors(self.config)
        part_of = dict(self._marked)
        for part in ("optimizer_state", "gradients", "parameters"):  # parameters win a tie
            for t in now[part]:
                storage = _storage(t)
                if storage is not None:
                    part_of[id(storage)] = part
        split = dict.fromkeys(MEMORY_PARTS, 0)
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is not None:
                split[part_of.get(key, "activations")] += storage.nbytes()
        return split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        found = collective(func, args)
        if found is not None:
            kind, tensors = found
            self.payload_bytes[kind] += tensor_bytes(tensors)
            self.calls[kind] += 1
            for t in tree_leaves(args):
                if isinstance(t, torch.Tensor):
                    self._track(t, _PART_OF_COLLECTIVE[kind])
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        total = self._total()
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_parts = self._split()
        return out
