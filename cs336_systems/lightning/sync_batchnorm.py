"""BatchNorm with statistics over the whole global batch, on CPUs as on GPUs.

With data parallelism each rank sees only its shard of the batch, so a plain BatchNorm
normalises by its shard's mean and variance, and its running statistics follow the shard's.
``torch.nn.SyncBatchNorm`` fixes that on GPUs only (its forward raises for CPU tensors), which
would leave ``Trainer(sync_batchnorm=True, accelerator="cpu")`` without a meaning.

:class:`GlobalBatchNorm` computes, per channel, the sum and the sum of squares of its rank's
shard and all-reduces them with the element count, in one collective: torch's differentiable
``all_reduce`` (``torch.distributed.nn``), whose backward all-reduces the gradient, so each
rank's input receives the gradient of every rank's loss through the shared statistics, as
one process holding the whole batch would compute it. The variance is ``E[x^2] - E[x]^2`` in
float32, which rounds differently from torch's two-pass variance (within 1e-5 on
unit-scale activations; the tests compare with one process on the whole batch). Running
statistics are updated as torch's BatchNorm does (momentum, unbiased variance).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad
from torch.nn.modules.batchnorm import _BatchNorm


class GlobalBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` whose training forward also runs on CPU tensors (gloo)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu":
            return super().forward(input)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not (self.training and distributed):
            return _BatchNorm.forward(self, input)  # local statistics suffice: torch's own path
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.float()
        count = torch.full((1,), x.numel() // channels, dtype=torch.float32)
        totals = all_reduce_with_grad(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = totals[-1]
        mean = totals[:channels] / n
        var = totals[channels:2 * channels] / n - mean * mean
        self._update_running_stats(mean.detach(), var.detach(), n.detach())
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        # momentum=None: a cumulative average, as torch's BatchNorm keeps it.
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with every BatchNorm layer replaced by a :class:`GlobalBatchNorm` holding its
    parameters and buffers (the layer itself when ``module`` is one)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
        converted = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                    module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_batchnorm(child))
    return module


class CPUSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's ``sync_batchnorm`` plugin, converting to :class:`GlobalBatchNorm`; reverting is
    Lightning's own (it turns any ``SyncBatchNorm`` back into a plain BatchNorm)."""

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_batchnorm(model)
