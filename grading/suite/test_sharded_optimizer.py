"""optimizer_state_sharding: an optimizer wrapper that keeps only this rank's share of the state.

The grader compares every rank's parameters with an unsharded optimizer's after every step, and
the state each rank holds with that optimizer's (grading/checks.py).
"""

import pytest

from grading.checks import ZeroCase, assert_sharded, run_sharded_optimizer

pytestmark = pytest.mark.problem("optimizer_state_sharding")


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size):
    """handout: the sharded optimizer steps each parameter as the wrapped optimizer would, and
    every rank ends each step with every parameter (AdamW)."""
    run_sharded_optimizer(ranks, world_size, ZeroCase())


def test_sgd_with_momentum(ranks):
    """handout: the wrapper takes any optimizer class and its keyword arguments (here SGD with momentum)."""
    run_sharded_optimizer(ranks, 2, ZeroCase(optimizer="sgd"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_is_sharded(ranks, world_size):
    """handout: each rank keeps the optimizer state of about 1/world size of the parameters."""
    reports, full = run_sharded_optimizer(ranks, world_size, ZeroCase())
    assert_sharded(reports, "state", full, "optimizer state")
