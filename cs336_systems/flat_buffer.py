"""One flat buffer holding many gradients, plus a usage flag per gradient.

Flat and bucketed DDP both reduce gradients through such a buffer: the gradients of
parameters sharing a dtype and device, back to back, followed by one flag per parameter (1 if
this rank has its gradient, else 0). One all-reduce then sums the gradients and, in the same
call, counts how many ranks contributed each one, which decides whether a gradient missing on
this rank is filled in (some rank used the parameter) or left ``None`` (no rank did).
"""

from __future__ import annotations

import torch
from torch import nn


class FlatGradBuffer:
    """Storage for one group of gradients: pack before the all-reduce, unpack after."""

    def __init__(self, params: list[nn.Parameter]):
        if not params:
            raise ValueError("a FlatGradBuffer needs at least one parameter")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"parameters of one buffer must share dtype and device, got {kinds}")
        self.params = params
        self.numels = [p.numel() for p in params]
        self.grad_numel = sum(self.numels)
        self.data = torch.zeros(
            self.grad_numel + len(params), dtype=params[0].dtype, device=params[0].device
        )

    @property
    def payload_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _grad_views(self) -> list[torch.Tensor]:
        return list(torch.split(self.data[: self.grad_numel], self.numels))

    def pack(self, world_size: int) -> None:
        """Copy local gradients in (zeros where missing), pre-divided by the world size.

        Dividing before the sum rather than after keeps low-precision values in range, as
        torch's DDP does.
        """
        flags = []
        for param, view in zip(self.params, self._grad_views()):
            if param.grad is None:
                view.zero_()
                flags.append(0.0)
            else:
                view.copy_(param.grad.reshape(-1))
                flags.append(1.0)
        self.data[: self.grad_numel].div_(world_size)
        self.data[self.grad_numel :].copy_(torch.tensor(flags, dtype=self.data.dtype))

    def unpack(self) -> None:
        """Write the reduced gradients back; leave ``None`` those that no rank produced."""
        ranks_with_grad = self.data[self.grad_numel :].tolist()
        for param, view, count in zip(self.params, self._grad_views(), ranks_with_grad):
            if count == 0:
                continue
            if param.grad is None:
                param.grad = view.view_as(param).clone()
            else:
                param.grad.copy_(view.view_as(param))
