"""Misuse fails fast with an error a person can act on, and a failing rank never hangs the run."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adapters
from cs336_systems.launch import RankContext, RankFailedError, launch
from tests.common import ToyModel

pytestmark = pytest.mark.problem("ddp_overlap_bucketed")


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "10", "Auto", True])
def test_bad_bucket_size_raises_before_any_collective(bad):
    # No process group exists in this process: reaching a collective would raise a
    # different error, so a ValueError shows the check comes first.
    with pytest.raises(ValueError, match="bucket_size_mb") as info:
        adapters.get_ddp_bucketed(ToyModel(), bucket_size_mb=bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    "wrap", [adapters.get_ddp_naive, adapters.get_ddp_flat, adapters.get_ddp_individual_parameters]
)
def test_module_without_parameters_raises(wrap):
    with pytest.raises(ValueError, match="no parameters"):
        wrap(nn.ReLU())


def test_wrapping_without_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        adapters.get_ddp_individual_parameters(ToyModel())


def _rank1_dies_mid_training(ctx: RankContext) -> None:
    ddp = adapters.get_ddp_bucketed(ToyModel(), bucket_size_mb=0.001)
    for step in range(3):
        if ctx.rank == 1 and step == 1:
            raise ValueError("rank 1 lost its data loader")
        F.mse_loss(ddp(torch.randn(4, 10)), torch.randn(4, 5)).backward()
        ddp.finish_gradient_synchronization()


@pytest.mark.timeout(300)
def test_a_failing_rank_fails_the_run_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 lost its data loader") as info:
        launch(_rank1_dies_mid_training, 2, timeout_s=30)
    assert str(info.value).startswith("rank1 failed first")
    # Rank 0 is blocked in an all-reduce when rank 1 dies: it must be ended well before its
    # 30 s collective timeout would (spawning itself takes ~5-10 s here).
    assert time.monotonic() - start < 60
