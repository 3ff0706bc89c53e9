"""Flat DDP (problem 4): after backward, one all-reduce over all gradients flattened.

Same result as naive DDP, but the per-call cost is paid once per dtype/device group instead
of once per parameter, at the price of copying every gradient into a flat buffer and back.
"""

from __future__ import annotations

from torch import nn

from cs336_systems.coalesced import group_by_dtype_and_device
from cs336_systems.ddp_base import DataParallel
from cs336_systems.flat_buffer import FlatGradBuffer


class FlatDDP(DataParallel):
    """Call :meth:`finish_gradient_synchronization` after ``backward()``, before the step."""

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__(module, process_group)
        # Allocated once: a fresh buffer per step would cost an allocation the size of the model.
        self._buffers = [FlatGradBuffer(g) for g in group_by_dtype_and_device(self.synced_params)]

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        for buffer in self._buffers:
            buffer.pack(self.world_size)
            self._all_reduce(buffer.data)
            buffer.unpack(self.world_size)
        self.allreduce_calls_last_step = len(self._buffers)
