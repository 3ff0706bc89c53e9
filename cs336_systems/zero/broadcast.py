"""The step's broadcasts: each owner sends its updated parameters to every other rank.

What a step sends is fixed (every parameter once, from its owner, in place on the receivers);
how it is sent decides what it costs beyond the wire. Three costs pull apart:

* every collective pays a fixed cost per call (tens of microseconds on gloo and NCCL alike),
  which favours packing many tensors into one flat buffer;
* packing is a pass over the bytes on every rank: the owner allocates the buffer and copies its
  parameters in, each receiver allocates one and copies them out. For a large parameter these
  passes cost far more than the one call they save;
* a blocking broadcast leaves the host waiting while it runs, and nothing else is issued meanwhile.

So a parameter that would fill a buffer alone, or of at least :data:`DIRECT_MIN_BYTES`, is
broadcast from its own storage, with no copy and no buffer; only smaller ones are packed, per
owner, dtype and device, into buffers of at most the bucket cap (the norms and biases of a
Transformer: a few calls instead of one per tensor). Every broadcast is issued asynchronously,
all in the same order on every rank, and all are finished before the step returns, as torch's
``ZeroRedundancyOptimizer`` does (``_broadcast_params_from_rank``, which sends every parameter
alone). Packed buffers in flight hold at most the bucket cap together: before one would push
them past it, the broadcasts issued so far are finished and unpacked.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from cs336_systems.comm.coalesced import chunk_by_bytes, copy_from_flat, flatten, group_by_dtype_and_device

# Sent alone from this size up, whatever the bucket cap. Packing saves one call (tens of
# microseconds) and costs two passes over the tensor's bytes; at 1 MiB the passes cost about as
# much as the call on a CPU, and large weight matrices (the bulk of the bytes) never pay them.
DIRECT_MIN_BYTES = 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it travels: booleans as bytes, since not every backend broadcasts ``torch.bool``."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class _InFlight:
    """The broadcasts of one step issued and not yet finished, and the packed buffers they fill."""

    def __init__(self, rank: int, cap_bytes: float):
        self.rank, self.cap_bytes = rank, cap_bytes
        self.works: list[dist.Work] = []
        self.buffers: list[torch.Tensor] = []  # kept alive until their broadcast is finished
        self.to_unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.packed_bytes = 0
        self.calls = 0

    def send(self, tensor: torch.Tensor, owner: int) -> None:
        self.works.append(dist.broadcast(tensor, src=owner, async_op=True))
        self.calls += 1

    def send_packed(self, run: list[torch.Tensor], owner: int) -> None:
        size = sum(_nbytes(t) for t in run)
        if self.packed_bytes and self.packed_bytes + size > self.cap_bytes:
            self.finish()
        if owner == self.rank:  # the owner sends what it holds and has nothing to unpack
            flat = flatten(run)
        else:  # a receiver's buffer is overwritten whole: no need to pack its stale values
            flat = torch.empty(sum(t.numel() for t in run), dtype=run[0].dtype, device=run[0].device)
            self.to_unpack.append((flat, run))
        self.buffers.append(flat)
        self.packed_bytes += size
        self.send(flat, owner)

    def finish(self) -> None:
        """Wait for every broadcast issued (on a GPU: the stream waits, not the host), then unpack."""
        for work in self.works:
            work.wait()
        for flat, run in self.to_unpack:
            copy_from_flat(flat, run)
        self.works, self.buffers, self.to_unpack, self.packed_bytes = [], [], [], 0


def broadcast_shards(shards: Sequence[Sequence[torch.Tensor]], rank: int, cap_bytes: float) -> int:
    """Broadcast ``shards[owner]`` from each owner to every rank, in place; returns the calls issued.

    A collective: every rank of the default process group calls it with the same shards (the
    same parameters, in the same order), so all issue the same broadcasts in the same order.
    Empty tensors carry nothing and are left out.
    """
    flight = _InFlight(rank, cap_bytes)
    alone_from = min(cap_bytes, DIRECT_MIN_BYTES)
    for owner, params in enumerate(shards):
        for same_kind in group_by_dtype_and_device(_wire(p.detach()) for p in params if p.numel()):
            packed = []
            for t in same_kind:
                # A broadcast needs one contiguous block; a strided parameter is packed whatever its size.
                if t.is_contiguous() and _nbytes(t) >= alone_from:
                    flight.send(t, owner)
                else:
                    packed.append(t)
            for run in chunk_by_bytes(packed, cap_bytes):
                flight.send_packed(run, owner)
    flight.finish()
    return flight.calls
