"""optimizer_state_sharding: an optimizer wrapper that keeps only this rank's share of the state.

Beyond the public tests: world size 3, and the state each rank holds, which must be about
1/world size of an unsharded optimizer's (one that keeps the full state on every rank fails).
"""

import pytest

from grading.cases import ZeroCase, train_sharded_optimizer

pytestmark = pytest.mark.problem("optimizer_state_sharding")


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size):
    ranks(train_sharded_optimizer, world_size, ZeroCase())


def test_sgd_with_momentum(ranks):
    ranks(train_sharded_optimizer, 2, ZeroCase(optimizer="sgd"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_is_sharded(ranks, world_size):
    """Six equal layers split evenly over 2 or 3 ranks: each holds 1/world size of the state; a
    quarter of the whole on top allows an uneven split by layers."""
    results = ranks(train_sharded_optimizer, world_size, ZeroCase())
    for rank, r in enumerate(results):
        share = r["state_bytes"] / r["full_state_bytes"]
        assert share <= 1 / world_size + 0.25, (
            f"rank {rank} holds {r['state_bytes']} bytes of optimizer state, {share:.0%} of an unsharded "
            f"optimizer's {r['full_state_bytes']}; a sharded one holds about 1/{world_size}")
