"""Naive DDP (problem 2): after backward, all-reduce every gradient, one call per parameter.

The simplest correct data parallelism and the baseline the other variants improve on: it
pays one collective's fixed cost per parameter tensor and overlaps nothing with backward.
"""

from __future__ import annotations

import torch

from cs336_systems.ddp_base import DataParallel


class NaiveDDP(DataParallel):
    """Call :meth:`finish_gradient_synchronization` after ``backward()``, before the step."""

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        # One small collective first, so that a parameter no rank used is skipped on every
        # rank alike, and one used by some ranks only is still reduced everywhere.
        counts, work = self._start_usage_count([p.grad is not None for p in self.synced_params])
        work.wait()
        calls = 1
        for param, ranks_with_grad in zip(self.synced_params, counts.tolist()):
            if ranks_with_grad == 0:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.div_(self.world_size)
            self._all_reduce(param.grad)
            calls += 1
        self.allreduce_calls_last_step = calls
