"""Naive DDP (problem 2): after backward, all-reduce every gradient, one call per parameter.

The simplest correct data parallelism and the baseline the other variants improve on: it
pays one collective's fixed cost per parameter tensor and overlaps nothing with backward.
"""

from __future__ import annotations

from typing import Any

import torch

from cs336_systems.ddp.base import DataParallel, UsageCount


class NaiveDDP(DataParallel):
    """Gradients are averaged when backward ends (base.py); then ``optimizer.step()``."""

    def __init__(self, module: torch.nn.Module, process_group=None, **torch_keywords: Any):
        """``torch_keywords``: torch's DDP keywords (torch_keywords.py)."""
        super().__init__(module, process_group, **torch_keywords)
        self._usage = UsageCount(self.synced_params)

    def _synchronize(self) -> None:
        # One small collective first, so that a parameter no rank used is skipped on every
        # rank alike, and one used by some ranks only is still reduced everywhere. A rank that
        # has every gradient knows every count is >= 1 without reading it.
        missing = self._missing_grads()
        self._usage.start(missing, self.comm)
        unused = {i for i, count in zip(missing, self._usage.read(missing)) if count == 0}
        calls = 1
        for i, param in enumerate(self.synced_params):
            if i in unused:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.comm.mean(param.grad)
            calls += 1
        self._usage.wait()
        self.allreduce_calls_last_step = calls

    def _release_comm(self) -> None:
        self._usage.wait()
