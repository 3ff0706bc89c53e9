"""Our buckets are torch's: the plan against torch's own assignment, and the wrapper against the plan.

The reference is ``torch.distributed._compute_bucket_assignment_by_size``, the function torch's
DDP builds its buckets with (reducer.cpp). Called with ``tensor_indices`` it takes the tensors in
the order given, as torch does when it rebuilds its buckets in the order gradients became ready
after the first step (our launch order), and lists buckets in the order they closed. The
buckets still open at the end follow in the order of a hash map, so where several dtypes leave
a bucket open the order is compared only up to them; the buckets themselves always.

Caps are whole numbers of bytes here: torch's are integers, ours floats (MB * 2**20), and a
cap between two integers would close at a different byte count in the two.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_basics.model import TransformerLM, model_config
from cs336_systems.ddp import BucketedDDP
from cs336_systems.ddp.bucket import plan_buckets
from tests.ddp_cases import MODELS
from tests.test_ddp_host_waits import fake_group  # noqa: F401 (fixture)

pytestmark = pytest.mark.problem("ddp_overlap_bucketed")

MB = 2**20
torch_assignment = getattr(dist, "_compute_bucket_assignment_by_size", None)
needs_torch_assignment = pytest.mark.skipif(
    torch_assignment is None, reason="this torch build has no _compute_bucket_assignment_by_size"
)


class OneHugeParameter(nn.Module):
    """A parameter far above the cap between small ones: torch lets it close the bucket it joins."""

    def __init__(self):
        super().__init__()
        self.small_in = nn.Linear(4, 4)
        self.huge = nn.Parameter(torch.zeros(64, 64))  # 16 KiB
        self.small_out = nn.Linear(4, 4)


def launch_order(module: nn.Module) -> list[nn.Parameter]:
    """Reverse registration order, where our wrappers start (the backward order of most models)."""
    return list(reversed([p for p in module.parameters() if p.requires_grad]))


def torch_plan(params: list[nn.Parameter], cap: int, first_cap: int | None) -> list[list[int]]:
    limits = [cap] if first_cap is None or first_cap >= cap else [first_cap, cap]
    assert torch_assignment is not None
    buckets, _ = torch_assignment(params, limits, [], list(range(len(params))))
    return [list(bucket) for bucket in buckets]


MODULES = {
    "edge": MODELS["edge"],  # float32 beside float64, tied and frozen parameters
    "routed": MODELS["routed"],
    "one-huge": OneHugeParameter,
    "lm-tiny": lambda: TransformerLM(model_config("tiny")),
}
CAPS = [(1, None), (629, None), (629, 256), (4096, None), (4096, 1024), (65536, 16384), (25 * MB, MB)]


@needs_torch_assignment
@pytest.mark.parametrize("cap, first_cap", CAPS, ids=[f"{c}-{f}" for c, f in CAPS])
@pytest.mark.parametrize("model", list(MODULES))
def test_plan_is_torchs_assignment(model: str, cap: int, first_cap: int | None):
    torch.manual_seed(0)
    params = launch_order(MODULES[model]())
    ours = plan_buckets(params, cap, first_cap)
    theirs = torch_plan(params, cap, first_cap)
    assert sorted(ours) == sorted(theirs)
    if len({p.dtype for p in params}) == 1:  # one dtype leaves at most one bucket open: order is torch's
        assert ours == theirs


def test_a_bucket_closes_once_it_reaches_the_cap():
    """By hand: 40-byte tensors under an 80-byte cap pair up; a 400-byte one closes the bucket
    it joins; the last bucket, below the cap, stays open to the end. With a first cap of 40
    bytes, the first bucket closes at the first tensor."""
    sizes = [10, 10, 5, 100, 10, 1]  # float32 elements: 40, 40, 20, 400, 40, 4 bytes
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    assert plan_buckets(params, 80) == [[0, 1], [2, 3], [4, 5]]
    assert plan_buckets(params, 80, first_cap_bytes=40) == [[0], [1, 2, 3], [4, 5]]
    assert plan_buckets(params, float("inf")) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("bucket_size_mb, first_bucket_mb", [(0.0625, 1.0), (0.25, 0.0625), (25.0, 1.0)])
def test_the_wrapper_builds_the_planned_buckets(fake_group, bucket_size_mb, first_bucket_mb):  # noqa: F811
    with torch.device("meta"):
        module = TransformerLM(model_config("tiny"))
    ddp = BucketedDDP(module, bucket_size_mb, first_bucket_mb=first_bucket_mb)
    order = {id(p): i for i, p in enumerate(ddp.launch_order)}
    built = [[order[id(p)] for p in bucket.params] for bucket in ddp.buckets]
    assert built == plan_buckets(ddp.launch_order, bucket_size_mb * MB, first_bucket_mb * MB)
    if torch_assignment is not None:
        assert len(built) == len(torch_plan(ddp.launch_order, int(bucket_size_mb * MB), int(first_bucket_mb * MB)))
