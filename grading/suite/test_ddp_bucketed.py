"""ddp_overlap_bucketed (2025): DDP that all-reduces buckets of gradients as they fill.

Every test trains through the submission's adapters; the grader compares every rank with
single-process training at every step (grading/suite/checks.py). Tests marked ``beyond_handout``
are reported and worth 0.
"""

import math

import pytest

from grading.readings import carried
from grading.suite.checks import DDPCase, findings, overlap_finding, run_ddp
from grading.suite.models import Equal

PROBLEM = "ddp_overlap_bucketed"
pytestmark = pytest.mark.problem(PROBLEM)

ADAPTERS = ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start")


def bucketed(bucket_size_mb: float, **kw) -> DDPCase:
    return DDPCase(*ADAPTERS, bucket_size_mb=bucket_size_mb, **kw)


@pytest.mark.parametrize("bucket_size_mb", [0.0005, 0.004, 1.0])
def test_matches_single_process(ranks, bucket_size_mb):
    """handout: training through the bucketed wrapper matches single-process training, whatever
    the bucket size (rank 0's weights broadcast at construction, gradients averaged)."""
    run_ddp(ranks, 2, bucketed(bucket_size_mb)).assert_matches()


def test_three_ranks(ranks):
    """handout: the same at world size 3 (the wrapper takes the world size from the process group)."""
    run_ddp(ranks, 3, bucketed(0.002)).assert_matches()


def test_tied_weights(ranks):
    """handout: the public tests' model ties two layers' weights; the tied gradient is reduced once."""
    run_ddp(ranks, 2, bucketed(0.002, model="tied")).assert_matches()


def test_communicates_during_backward(ranks):
    """handout: a bucket is all-reduced as soon as all of its gradients are ready, during backward,
    asynchronously ("wait for asynchronous communication calls" after backward); with buckets
    smaller than one layer, the wrapper still trains as single-process training does. In namespace
    mode, from outside the ranks too (grading/readings/carried.py): the bytes carried before backward
    reaches the first layer, and once."""
    run = run_ddp(ranks, 2, bucketed(0.0005))
    outside, mismatch = carried.ddp_overlap_finding(ranks, bucketed(0.0005), PROBLEM)
    findings(outside, overlap_finding(run.reports, "net", PROBLEM), run.mismatch, mismatch)


@pytest.mark.parametrize("bucket_size_mb", [0.01, 1.0])
def test_all_reduces_follow_bucket_size(ranks, bucket_size_mb):
    """handout: bucket_size_mb is the largest size of a bucket: parameters are grouped into buckets
    of at most that size, one all-reduce each.

    A bucket holds at most the cap plus one tensor (closing once full, as torch's DDP does, or
    before overflowing), and a closed bucket holds more than the cap less one tensor: so the count
    per step lies in [total / (cap + largest), total / (cap - largest) + 1]. MB may mean 10^6 or 2^20.
    An all-reduce counts as a bucket only if it carries at least the smallest gradient, and none
    carries more than the cap plus one tensor."""
    model = Equal()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total, largest = sum(sizes), max(sizes)
    cap_high = bucket_size_mb * 2**20
    low = max(1, math.ceil(total / (cap_high + largest)))
    cap_low = bucket_size_mb * 1e6
    high = math.floor(total / (cap_low - largest)) + 1 if cap_low > largest else len(sizes)
    high = min(high, len(sizes))
    run = run_ddp(ranks, 2, bucketed(bucket_size_mb, model="equal"))
    steps = run.reports[0]["reductions"][1:]  # after the first step, which may build the buckets
    counts = [sum(nbytes >= min(sizes) for nbytes, _, _ in calls) for calls in steps]
    over = [nbytes for calls in steps for nbytes, _, _ in calls if nbytes > min(cap_high, total) + largest]
    found = "" if all(low <= n <= high for n in counts) else (
        f"{counts} all-reduces of a gradient or more per step (steps 2 and 3, rank 0) for {len(sizes)} gradients of "
        f"{total} bytes with bucket_size_mb={bucket_size_mb}; buckets of that size make {low} to {high}")
    if over and not found:
        found = (f"an all-reduce of {max(over)} bytes with bucket_size_mb={bucket_size_mb} (steps 2 and 3, rank 0): "
                 f"a bucket holds at most the cap plus one gradient ({largest} bytes)")
    findings(found, run.mismatch)


def test_adamw(ranks):
    """handout: every rank keeps an identical copy of the parameters and of the optimizer's state
    (the handout names Adam's statistics): here AdamW."""
    run_ddp(ranks, 2, bucketed(0.002, optimizer="adamw")).assert_matches()


@pytest.mark.beyond_handout
def test_unused_layer(ranks):
    """beyond the handout: a layer no rank uses (torch's DDP refuses it unless find_unused_parameters=True)."""
    run_ddp(ranks, 2, bucketed(0.002, model="unused")).assert_matches()
