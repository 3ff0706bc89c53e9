"""ddp_overlap_bucketed (2025): DDP that all-reduces buckets of gradients as they fill.

Every test trains through the submission's adapters; the grader compares every rank with
single-process training at every step (grading/checks.py). Tests marked ``beyond_handout``
are reported and worth 0.
"""

import math

import pytest

from grading.checks import DDPCase, run_ddp
from grading.models import Equal

pytestmark = pytest.mark.problem("ddp_overlap_bucketed")

ADAPTERS = ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start")


def bucketed(bucket_size_mb: float, **kw) -> DDPCase:
    return DDPCase(*ADAPTERS, bucket_size_mb=bucket_size_mb, **kw)


@pytest.mark.parametrize("bucket_size_mb", [0.0005, 0.004, 1.0])
def test_matches_single_process(ranks, bucket_size_mb):
    """handout: training through the bucketed wrapper matches single-process training, whatever
    the bucket size (rank 0's weights broadcast at construction, gradients averaged)."""
    run_ddp(ranks, 2, bucketed(bucket_size_mb))


def test_three_ranks(ranks):
    """handout: the same at world size 3 (the wrapper takes the world size from the process group)."""
    run_ddp(ranks, 3, bucketed(0.002))


def test_tied_weights(ranks):
    """handout: the public tests' model ties two layers' weights; the tied gradient is reduced once."""
    run_ddp(ranks, 2, bucketed(0.002, model="tied"))


def test_communicates_during_backward(ranks):
    """handout: a bucket is all-reduced as soon as all of its gradients are ready, during backward."""
    during = [r["during_backward"] for r in run_ddp(ranks, 2, bucketed(0.0005))]
    assert all(n > 0 for per_rank in during for n in per_rank), (
        f"no all-reduce was issued while backward ran (per rank and step: {during}), with buckets "
        "smaller than one layer: a bucket must be sent once it is full, not after backward")


@pytest.mark.parametrize("bucket_size_mb", [0.01, 1.0])
def test_all_reduces_follow_bucket_size(ranks, bucket_size_mb):
    """handout: bucket_size_mb is the largest size of a bucket: parameters are grouped into buckets
    of at most that size, one all-reduce each.

    A bucket holds at most the cap plus one tensor (closing once full, as torch's DDP does, or
    before overflowing), and a closed bucket holds more than the cap less one tensor: so the count
    per step lies in [total / (cap + largest), total / (cap - largest) + 1]. MB may mean 10^6 or 2^20."""
    model = Equal()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total, largest = sum(sizes), max(sizes)
    low = max(1, math.ceil(total / (bucket_size_mb * 2**20 + largest)))
    cap_low = bucket_size_mb * 1e6
    high = math.floor(total / (cap_low - largest)) + 1 if cap_low > largest else len(sizes)
    high = min(high, len(sizes))
    reports = run_ddp(ranks, 2, bucketed(bucket_size_mb, model="equal"))
    counts = reports[0]["reductions"][1:]  # after the first step, which may build the buckets
    assert all(low <= n <= high for n in counts), (
        f"{counts} all-reduces per step (steps 2 and 3, rank 0) for {len(sizes)} gradients of {total} bytes with "
        f"bucket_size_mb={bucket_size_mb}; buckets of that size make {low} to {high}")


def test_adamw(ranks):
    """handout: every rank keeps an identical copy of the parameters and of the optimizer's state
    (the handout names Adam's statistics): here AdamW."""
    run_ddp(ranks, 2, bucketed(0.002, optimizer="adamw"))


@pytest.mark.beyond_handout
def test_unused_layer(ranks):
    """beyond the handout: a layer no rank uses (torch's DDP refuses it unless find_unused_parameters=True)."""
    run_ddp(ranks, 2, bucketed(0.002, model="unused"))
