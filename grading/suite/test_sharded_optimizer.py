"""optimizer_state_sharding: an optimizer wrapper that keeps only this rank's share of the state.

The grader compares every rank's parameters with an unsharded optimizer's after every step, and
the state each rank holds (every tensor alive in the rank but the model's, its gradients and the
grader's data: a module-level global counts too) with that optimizer's (grading/checks.py).
"""

import pytest

from grading.checks import ZeroCase, findings, run_sharded_optimizer, sharding_finding

PROBLEM = "optimizer_state_sharding"
pytestmark = pytest.mark.problem(PROBLEM)


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size):
    """handout: "Calls the wrapped optimizer's step() method ... After updating the parameters,
    synchronize with the other ranks": each parameter is stepped as the unsharded optimizer steps
    it, and every rank ends each step with every parameter (AdamW)."""
    run_sharded_optimizer(ranks, world_size, ZeroCase()).assert_matches()


def test_sgd_with_momentum(ranks):
    """handout: "The class should wrap an arbitrary input PyTorch optim.Optimizer": here SGD with momentum."""
    run_sharded_optimizer(ranks, 2, ZeroCase(optimizer="sgd")).assert_matches()


@pytest.mark.parametrize("world_size, optimizer", [(2, "sgd"), (3, "adamw")])
def test_parameter_groups(ranks, world_size, optimizer):
    """handout: "params is a collection of parameters to be optimized (or parameter groups, in case
    the user wants to use different hyperparameters, such as learning rates, for different parts of
    the model)": two groups with their own lr (and weight_decay) train as the unsharded optimizer does."""
    run_sharded_optimizer(ranks, world_size, ZeroCase(optimizer=optimizer, groups=True)).assert_matches()


@pytest.mark.parametrize("world_size, optimizer", [(2, "adamw"), (3, "sgd")])
def test_add_param_group(ranks, world_size, optimizer):
    """handout: add_param_group "may also be called during training (e.g., for gradually unfreezing
    layers in a model). As a result, this method should handle assigning the model's parameters
    among the ranks": two frozen layers, added as a group of their own (the constructor's options)
    after step 1, train from step 2 on."""
    run_sharded_optimizer(ranks, world_size, ZeroCase(optimizer=optimizer, unfreeze=True)).assert_matches()


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_is_sharded(ranks, world_size):
    """handout: "these parameters will be sharded across all the ranks": each rank keeps the
    optimizer state of about 1/world size of the parameters, and still trains as the unsharded one."""
    run = run_sharded_optimizer(ranks, world_size, ZeroCase(measure_state=True))
    findings(sharding_finding(run.reports, "state", run.full_bytes, "optimizer state", PROBLEM), run.mismatch)
