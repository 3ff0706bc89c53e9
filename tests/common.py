"""Helpers with the names the public CS336 DDP tests import (``from .common import ...``).

The models are the small networks those tests train: ``ToyModel`` has a frozen bias and a
parameter that never requires grad; ``ToyModelWithTiedWeights`` uses one weight in two layers.
Ours beside them: ``SmallCNN``, whose BatchNorm keeps buffers.
"""

from __future__ import annotations

import os
import pathlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.launch import teardown  # imported before any group exists (launch/lifetime.py)

FIXTURES_PATH = pathlib.Path(__file__).resolve().parent / "fixtures"


def validate_ddp_net_equivalence(net: nn.Module) -> None:
    """Assert every tensor of ``net.module.state_dict()`` is the same on all ranks."""
    for tensor in net.module.state_dict().values():
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        for other in gathered:
            assert torch.allclose(other, tensor)


class _FC2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 5, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_fixed_param = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class ToyModelWithTiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 10, bias=False)
        self.fc4 = nn.Linear(10, 50, bias=False)
        self.fc5 = nn.Linear(50, 5, bias=False)
        self.fc4.weight = self.fc2.weight
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.relu(self.fc3(x))
        x = self.relu(self.fc4(x))
        return self.fc5(x)


class SmallCNN(nn.Module):
    """A convolution, BatchNorm and a head: a model with buffers (running statistics), not the course's."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _setup_process_group(rank: int, world_size: int, backend: str) -> str:
    """Join the test's process group; returns the device string this rank should use.

    The rendezvous port comes from MASTER_PORT, which tests/conftest.py sets to a free port
    for every test (spawned ranks inherit it), so parallel test runs never collide.
    """
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            "MASTER_PORT is not set: run this through pytest, whose tests/conftest.py picks a "
            "free port for each test"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    # As in the public suite's helper: on a machine with GPUs every rank computes on one, with
    # gloo too (gloo all-reduces CUDA tensors by staging them through host memory).
    if torch.cuda.is_available():
        local_rank = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def _cleanup_process_group() -> None:
    """Wait for every rank, destroy the group and free it (its gloo workers joined)."""
    teardown()
