"""Packing many tensors into few flat buffers, so one collective moves them all.

Every collective pays a fixed per-call cost; packing tensors of one dtype and device into a
single contiguous buffer turns N calls into one. Buffers are capped (``chunk_bytes``) so that
packing a multi-gigabyte model never needs a second full copy of it in memory.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 64 * 2**20


def group_by_dtype_and_device(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors split into runs that can share one flat buffer, keeping their order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    return list(groups.values())


def chunk_by_bytes(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of at most ``chunk_bytes`` (a tensor larger than that forms its own run)."""
    run: list[torch.Tensor] = []
    run_bytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if run and run_bytes + size > chunk_bytes:
            yield run
            run, run_bytes = [], 0
        run.append(t)
        run_bytes += size
    if run:
        yield run


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new contiguous 1-D tensor holding ``tensors`` back to back."""
    return torch.cat([t.reshape(-1) for t in tensors])


def copy_from_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`flatten`: copy consecutive slices of ``flat`` into ``tensors``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_coalesced(
    tensors: Iterable[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Broadcast ``tensors`` in place from global rank ``src``; returns the number of calls.

    Tensors appearing twice (tied weights) are sent once. Boolean tensors travel as bytes,
    because not every backend reduces or broadcasts ``torch.bool``.
    """
    unique: dict[int, torch.Tensor] = {}
    for t in tensors:
        unique.setdefault(id(t), t)
    calls = 0
    for same_kind in group_by_dtype_and_device(unique.values()):
        for run in chunk_by_bytes(same_kind, chunk_bytes):
            wire = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in run]
            flat = flatten(wire)
            dist.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                copy_from_flat(flat, wire)
            # Dropped before the next chunk is packed: one chunk alive at a time bounds the
            # transient memory by chunk_bytes, not twice that.
            del flat, wire
            calls += 1
    return calls
