"""Gradients on their way back to the shards: reductions in flight, replicas, replicated parameters.

The schedule (schedule.py) decides when a unit's gradients are complete; :class:`Reductions`
then launches the unit's reduce-scatter asynchronously, so it overlaps the rest of backward,
and keeps at most :data:`MAX_REDUCTIONS_IN_FLIGHT` pending: the oldest is waited for before
another starts, which bounds the full-size gradients alive. With hybrid sharding each slice,
once reduce-scattered within its shard group, is all-reduced across the replicas; that
all-reduce starts only after the reduce-scatter's wait, since collectives on two groups are not
ordered with each other. Parameters left replicated (the handout's sharding keeps biases and
gains whole) have their gradients all-reduced in one flattened buffer when backward ends.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.fsdp.unit import Unit

# Two: the one just launched can overlap the next unit's backward while the one before it
# finishes; more would keep more full-size gradients alive for little extra overlap.
MAX_REDUCTIONS_IN_FLIGHT = 2


class Reductions:
    """The reduce-scatters (and replica all-reduces) of one schedule still in flight."""

    def __init__(self, world_size: int, group: dist.ProcessGroup | None, reduce_dtype: torch.dtype,
                 replicate_group: dist.ProcessGroup | None):
        self.world_size = world_size  # gradients are averaged over every rank
        self.group = group  # replicated parameters' all-reduce (None: the world)
        self.reduce_dtype = reduce_dtype
        self.replicate_group = replicate_group  # None: no replicas
        self._in_flight: deque[tuple[dist.Work, torch.Tensor, torch.Tensor]] = deque()  # work, in, out
        self._replica_in_flight: deque[dist.Work] = deque()

    def launch(self, unit: Unit) -> None:
        """Start the reduce-scatter of ``unit``'s summed gradients (after the oldest, if too many)."""
        while len(self._in_flight) >= MAX_REDUCTIONS_IN_FLIGHT:
            self._retire_oldest()
        self._in_flight.append(unit.reduce_scatter(self.reduce_dtype))

    def _retire_oldest(self) -> None:
        """Wait for the oldest reduce-scatter; with replicas, launch its all-reduce across them."""
        work, _, reduced = self._in_flight.popleft()
        work.wait()
        if self.replicate_group is not None:
            self._replica_in_flight.append(dist.all_reduce(reduced, group=self.replicate_group, async_op=True))

    def wait_all(self) -> None:
        """Wait for every reduction launched, replica all-reduces included."""
        while self._in_flight:
            self._retire_oldest()
        while self._replica_in_flight:
            self._replica_in_flight.popleft().wait()

    def all_reduce_replicated(self, replicated: list[nn.Parameter]) -> None:
        """One all-reduce of every replicated gradient, flattened (they are small: gains, biases).

        A parameter without a gradient on this rank contributes zeros, so every rank passes a
        buffer of the same layout; afterwards every replicated parameter has the average.
        """
        params = [p for p in replicated if p.requires_grad]
        if not params:
            return
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.reduce_dtype)
            for p in params
        ])
        dist.all_reduce(flat, group=self.group)
        flat = flat.to(torch.float32).div_(self.world_size)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
