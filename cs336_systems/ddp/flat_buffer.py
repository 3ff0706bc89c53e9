"""One flat buffer holding many gradients, plus a usage flag per gradient.

Flat and bucketed DDP both reduce gradients through such a buffer: the gradients of
parameters sharing a dtype and device, back to back, followed by one flag per parameter (1 if
this rank has its gradient, else 0). One all-reduce then reduces the gradients and, in the same
call, the flags, which say whether a gradient missing on this rank is filled in (some rank
used the parameter) or left ``None`` (no rank did). The flags are written on the device, so
packing never copies host data in; only a rank that lacks a gradient reads them back.

Two options trade generality for speed:

* ``grad_views``: each parameter's ``.grad`` becomes a view into the buffer (torch DDP's
  ``gradient_as_bucket_view``), so the reduced values need no copy back and, when gradients
  are zeroed rather than set to ``None``, backward accumulates straight into the buffer;
* ``comm_dtype``: communicate in a narrower dtype (e.g. bfloat16: half the bytes). The sum is
  then taken in that dtype and the average formed afterwards in the parameter's dtype, so the
  division does not add a second rounding in low precision.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class FlatGradBuffer:
    """Storage for one group of gradients: pack before the all-reduce, unpack after."""

    def __init__(
        self,
        params: list[nn.Parameter],
        comm_dtype: torch.dtype | None = None,
        grad_views: bool = False,
    ):
        if not params:
            raise ValueError("a FlatGradBuffer needs at least one parameter")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"parameters of one buffer must share dtype and device, got {kinds}")
        param_dtype = params[0].dtype
        self.comm_dtype = comm_dtype or param_dtype
        if grad_views and self.comm_dtype != param_dtype:
            raise ValueError(
                f"gradients cannot be views of a {self.comm_dtype} buffer for {param_dtype} "
                "parameters: use grad_views=False with comm_dtype"
            )
        self.params = params
        self.grad_views = grad_views
        self.numels = [p.numel() for p in params]
        self.grad_numel = sum(self.numels)
        self.data = torch.zeros(
            self.grad_numel + len(params), dtype=self.comm_dtype, device=params[0].device
        )
        self.flags = self.data[self.grad_numel :]
        self._slots = list(torch.split(self.data[: self.grad_numel], self.numels))
        self._index = {id(p): i for i, p in enumerate(params)}
        # Average inside the collective when it runs in the parameters' own dtype, as torch's
        # DDP does; with a narrower comm dtype, sum there and divide after, in full width.
        self.averaged_in_comm = self.comm_dtype == param_dtype
        self.missing: list[int] = []  # set by pack(): positions with no local gradient

    @property
    def payload_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _is_view(self, i: int) -> bool:
        grad = self.params[i].grad
        return grad is not None and grad.data_ptr() == self._slots[i].data_ptr()

    def adopt_grad(self, param: nn.Parameter) -> None:
        """With ``grad_views``: move ``param``'s fresh gradient into its slot, point ``.grad``
        at the slot. Called as each gradient becomes ready, so the copies spread over backward."""
        i = self._index[id(param)]
        if not self.grad_views or param.grad is None or self._is_view(i):
            return
        self._slots[i].copy_(param.grad.reshape(-1))
        param.grad = self._slots[i].view_as(param)

    def pack(self) -> None:
        """Bring every local gradient into the buffer (zeros where missing) and set the flags."""
        missing = []
        for i, (param, slot) in enumerate(zip(self.params, self._slots)):
            if param.grad is None:
                slot.zero_()
                missing.append(i)
            elif not self._is_view(i):
                slot.copy_(param.grad.reshape(-1))
                if self.grad_views:
                    param.grad = slot.view_as(param)
        self.flags.fill_(1)
        for i in missing:
            self.flags[i].fill_(0)
        self.missing = missing

    def unpack(self, world_size: int, missing_flags: Sequence[float] = ()) -> None:
        """Write the averaged gradients back; leave ``None`` those that no rank produced.

        ``missing_flags`` are the reduced flags at :attr:`missing` (see :func:`read_missing_flags`).
        """
        if len(missing_flags) != len(self.missing):
            raise ValueError(f"expected {len(self.missing)} flags, one per missing gradient, got {len(missing_flags)}")
        if self.grad_views and not self.missing:
            return  # pack() made every gradient a view of the reduced buffer
        unused = {i for i, flag in zip(self.missing, missing_flags) if flag == 0}
        for i, (param, slot) in enumerate(zip(self.params, self._slots)):
            if i in unused:
                continue
            if self.grad_views:
                if not self._is_view(i):
                    param.grad = slot.view_as(param)
                continue
            reduced = slot.view_as(param)
            if not self.averaged_in_comm:
                reduced = reduced.to(param.dtype) / world_size
            if param.grad is None:
                param.grad = reduced.to(param.dtype, copy=True)
            else:
                param.grad.copy_(reduced)


def read_missing_flags(buffers: Sequence[FlatGradBuffer]) -> list[list[float]]:
    """Each buffer's reduced flags at its missing positions, in one host-device wait for all
    buffers together, and in none when no buffer lacks a gradient (the usual step)."""
    needy = [b for b in buffers if b.missing]
    if not needy:
        return [[] for _ in buffers]
    values = iter(torch.stack([b.flags[i] for b in needy for i in b.missing]).tolist())
    return [[next(values) for _ in b.missing] for b in buffers]
