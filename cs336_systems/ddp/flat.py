"""Flat DDP (problem 4): after backward, one all-reduce over all gradients flattened.

Same result as naive DDP, but the per-call cost is paid once per dtype/device group instead
of once per parameter, at the price of copying every gradient into a flat buffer and back (a
bucket per dtype and device: bucket.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cs336_systems.comm.coalesced import group_by_dtype_and_device
from cs336_systems.ddp.base import DataParallel
from cs336_systems.ddp.bucket import GradBucket, write_reduced_grads


class FlatDDP(DataParallel):
    """Gradients are averaged when backward ends (base.py); then ``optimizer.step()``."""

    def __init__(self, module: nn.Module, process_group=None, **torch_keywords: Any):
        """``torch_keywords``: torch's DDP keywords (torch_keywords.py)."""
        super().__init__(module, process_group, **torch_keywords)
        # Allocated once: a fresh buffer per step would cost an allocation the size of the model.
        self._buckets = [GradBucket(g) for g in group_by_dtype_and_device(self.synced_params)]

    def _synchronize(self) -> None:
        for bucket in self._buckets:
            bucket.launch(self.comm)
        write_reduced_grads(self._buckets, self.world_size)
        self.allreduce_calls_last_step = len(self._buckets)

    def _release_comm(self) -> None:
        for bucket in self._buckets:
            bucket.wait()
        self._buckets = []
