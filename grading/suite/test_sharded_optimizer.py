"""optimizer_state_sharding: an optimizer wrapper that keeps only this rank's share of the state.

Beyond the public tests: world size 3, and the state each rank holds, which must be about
1/world size of an unsharded optimizer's (one that keeps the full state on every rank fails).
"""

import pytest

from grading.cases import ZeroCase, assert_sharded, train_sharded_optimizer

pytestmark = pytest.mark.problem("optimizer_state_sharding")


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size):
    ranks(train_sharded_optimizer, world_size, ZeroCase())


def test_sgd_with_momentum(ranks):
    ranks(train_sharded_optimizer, 2, ZeroCase(optimizer="sgd"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_is_sharded(ranks, world_size):
    assert_sharded(ranks(train_sharded_optimizer, world_size, ZeroCase()), "state_bytes", "full_state_bytes",
                   "optimizer state")
