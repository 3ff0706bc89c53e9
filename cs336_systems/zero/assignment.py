"""Which rank owns which parameter: a greedy, byte-balanced assignment every rank computes alike."""

from __future__ import annotations

import heapq
from typing import Sequence

import torch


def parameter_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s elements: what its owner's optimizer state scales with."""
    return param.numel() * param.element_size()


def assign_to_ranks(
    sizes: Sequence[int], world_size: int, initial_loads: Sequence[int] | None = None
) -> list[int]:
    """The owner rank of each item: largest first, each to the currently least-loaded rank.

    Ties go to the lower item index and the lower rank, so every rank computes the same
    assignment from the same sizes without communicating. Greedy placement keeps
    ``max(load) - min(load) <= max(size)`` whatever the order (placing ``s`` on the least-loaded
    rank cannot push it more than ``s`` above the others), provided ``initial_loads`` already
    satisfied that bound, as loads produced by this function do: parameters added later land on
    top of the current loads without breaking balance.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    negative = [s for s in sizes if s < 0]
    if negative:
        raise ValueError(f"sizes must be >= 0, got {negative[:5]}")
    loads = [0] * world_size if initial_loads is None else list(initial_loads)
    if len(loads) != world_size:
        raise ValueError(
            f"initial_loads has {len(loads)} entries, but world_size is {world_size}"
        )
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + sizes[index], rank))
    return owners
