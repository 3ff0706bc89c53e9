"""The one collective of DDP: an all-reduce that averages a gradient over the ranks.

NCCL averages in the collective itself (``ReduceOp.AVG``, NCCL >= 2.10), which saves a
division kernel per call: per-parameter DDP makes one call per parameter. gloo has no AVG in
many torch versions, so there we divide by the world size first and sum, as torch's DDP does
(dividing before summing also keeps low-precision sums in range).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MeanAllReduce:
    """All-reduces over one process group: :meth:`mean` for gradients, :meth:`sum` for counts."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.native_average = dist.get_backend(group) == "nccl"

    def mean(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Replace ``tensor`` by its average over the ranks."""
        if self.native_average:
            return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=async_op)
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def sum(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Replace ``tensor`` by its sum over the ranks."""
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)
