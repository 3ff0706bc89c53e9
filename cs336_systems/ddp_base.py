"""What every DDP variant shares: construction, the forward pass, ``no_sync`` and unused parameters.

Data parallelism keeps one full replica of the model per rank, gives each rank a different
shard of the batch, and averages gradients across ranks before the optimizer step, so every
replica takes the same step as single-process training on the whole batch would.

At construction every variant

* checks its arguments before issuing any collective (a bad call fails on its own rank with a
  ValueError instead of leaving the other ranks blocked in a broadcast);
* broadcasts rank 0's parameters *and buffers*, so replicas start identical even when ranks
  were seeded differently;
* lists the parameters it synchronises: ``module.parameters()`` already yields a tied weight
  once (so it is reduced once), and frozen parameters (``requires_grad=False``) get no
  gradient, so they are skipped.

Gradients are averaged by dividing by the world size and summing, not with ``ReduceOp.AVG``,
which the gloo backend does not implement in many torch versions.

Unused parameters: a parameter may get no gradient on some ranks (a branch not taken for this
rank's data). Single-process training on the whole batch would give it the gradient of the
ranks that did use it, and leave it ``None`` only if no rank did (optimizers skip ``None``
gradients, so a zero gradient would wrongly apply weight decay). Each variant therefore
learns, with the same communication on every rank, how many ranks produced each gradient:
missing local gradients count as zeros, and a gradient stays ``None`` only where that count
is zero everywhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.coalesced import broadcast_coalesced


def _check_module(module: nn.Module) -> list[nn.Parameter]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to wrap, got {type(module).__name__}")
    params = list(module.parameters())
    if not params:
        raise ValueError(
            f"{type(module).__name__} has no parameters: there is nothing to keep in sync"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "the default process group is not initialised: call "
            "cs336_systems.process_group.init_from_env() (or launch()) before wrapping a model"
        )
    return params


class DataParallel(nn.Module):
    """Base of the DDP variants: wraps ``module`` (kept as ``.module``) and keeps replicas equal.

    Subclasses implement :meth:`finish_gradient_synchronization`, called after ``backward()``
    and before ``optimizer.step()``.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        params = _check_module(module)
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # Parameters that receive gradients, in registration order, each once.
        self.synced_params: list[nn.Parameter] = [p for p in params if p.requires_grad]
        # Set by no_sync(); read at forward time, as torch's DDP does, so that a forward run
        # inside no_sync() marks its backward as local-only wherever backward() is called.
        self.require_backward_grad_sync = True
        self._sync_this_backward = True
        self.allreduce_calls_last_step = 0
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        broadcast_coalesced(
            list(module.parameters()) + list(module.buffers()), src=src, group=process_group
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        self._sync_this_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    def detach(self) -> None:
        """Stop acting on the module's backward passes (other wrappers may take over)."""

    def _before_forward(self) -> None:
        """Hook for subclasses that must check or reset per-step state."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run inside this context
        skip communication; the first synchronised step afterwards reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def on_train_batch_start(self) -> None:
        """Called at the start of a training step; variants with per-step state reset it."""

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        return dist.all_reduce(tensor, group=self.process_group, async_op=async_op)

    def _start_usage_count(self, locally_used: list[bool]) -> tuple[torch.Tensor, dist.Work]:
        """Start summing, over ranks, which of ``synced_params`` have a gradient on each rank.

        Returns the tensor that will hold the counts and the async work to wait on. The counts
        are small integers, exact in float32; float32 is used because every backend reduces it.
        """
        device = self.synced_params[0].device
        counts = torch.tensor(locally_used, dtype=torch.float32, device=device)
        work = self._all_reduce(counts, async_op=True)
        return counts, work
