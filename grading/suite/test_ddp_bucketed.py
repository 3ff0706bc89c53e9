"""ddp_overlap_bucketed (2025): DDP that all-reduces buckets of gradients as they fill.

Beyond the public tests: world size 3, weights no seed reproduces, AdamW, tied weights, a layer
no rank uses, communication during backward, and the number of all-reduces per step against
the bucket size (a bucketed DDP that ignores ``bucket_size_mb`` fails).
"""

import math

import pytest

from grading.cases import DDPCase, Equal, train_ddp

pytestmark = pytest.mark.problem("ddp_overlap_bucketed")

ADAPTERS = ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start")


def bucketed(bucket_size_mb: float, **kw) -> DDPCase:
    return DDPCase(*ADAPTERS, bucket_size_mb=bucket_size_mb, **kw)


@pytest.mark.parametrize("bucket_size_mb", [0.0005, 0.004, 1.0])
def test_matches_single_process(ranks, bucket_size_mb):
    ranks(train_ddp, 2, bucketed(bucket_size_mb))


def test_three_ranks(ranks):
    ranks(train_ddp, 3, bucketed(0.002))


def test_adamw(ranks):
    ranks(train_ddp, 2, bucketed(0.002, optimizer="adamw"))


def test_tied_weights(ranks):
    ranks(train_ddp, 2, bucketed(0.002, model="tied"))


def test_unused_layer(ranks):
    ranks(train_ddp, 2, bucketed(0.002, model="unused"))


def test_communicates_during_backward(ranks):
    results = ranks(train_ddp, 2, bucketed(0.0005))
    during = [r["during_backward"] for r in results]
    assert all(n > 0 for per_rank in during for n in per_rank), (
        f"no all-reduce was issued while backward ran (per rank and step: {during}), with buckets "
        "smaller than one layer: a bucket must be sent once it is full, not after backward")


@pytest.mark.parametrize("bucket_size_mb", [0.01, 1.0])
def test_all_reduces_follow_bucket_size(ranks, bucket_size_mb):
    """A bucket holds at most the cap plus one tensor (closing once full, as torch's DDP does, or
    before overflowing), and a closed bucket holds more than the cap less one tensor: so the count
    per step lies in [total / (cap + largest), total / (cap - largest) + 1]. MB may mean 10^6 or 2^20."""
    model = Equal()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total, largest = sum(sizes), max(sizes)
    low = max(1, math.ceil(total / (bucket_size_mb * 2**20 + largest)))
    cap_low = bucket_size_mb * 1e6
    high = math.floor(total / (cap_low - largest)) + 1 if cap_low > largest else len(sizes)
    high = min(high, len(sizes))
    results = ranks(train_ddp, 2, bucketed(bucket_size_mb, model="equal"))
    counts = results[0]["reductions"][1:]  # after the first step, which may build the buckets
    assert all(low <= n <= high for n in counts), (
        f"{counts} all-reduces per step for {len(sizes)} gradients of {total} bytes with "
        f"bucket_size_mb={bucket_size_mb}; buckets of that size make {low} to {high}")
