"""optimizer_state_sharding: an optimizer wrapper that keeps only this rank's share of the state.

The grader compares every rank's parameters with an unsharded optimizer's after every step, and
the state each rank holds with that optimizer's: the rank's resident memory beyond the model's
parameters, read by the grader from outside the rank while it is stopped after each step
(grading/readings/outside.py, grading/readings/memory.py), wherever the submission keeps it.
"""

import pytest

from grading.suite.checks import ZeroCase, findings, run_sharded_optimizer
from grading.readings.memory import inside_state, judged, state_finding

PROBLEM = "optimizer_state_sharding"
pytestmark = pytest.mark.problem(PROBLEM)


MEASURED = ZeroCase(measure_state=True)
_measured: dict[tuple[int, int], object] = {}  # (world size, repetition) -> its run: one run serves both checks


def measured(ranks, world_size: int, repetition: int):
    if (world_size, repetition) not in _measured:
        _measured[world_size, repetition] = run_sharded_optimizer(ranks, world_size, MEASURED)
    return _measured[world_size, repetition]


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size, repetition):
    """handout: "Calls the wrapped optimizer's step() method ... After updating the parameters,
    synchronize with the other ranks": each parameter is stepped as the unsharded optimizer steps
    it, and every rank ends each step with every parameter (AdamW)."""
    measured(ranks, world_size, repetition).assert_matches()


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
def test_state_is_sharded(ranks, world_size, repetition):
    """handout: "these parameters will be sharded across all the ranks": no rank keeps much more
    than the optimizer state of 1/world size of the parameters (its memory read from outside), and
    it still trains as the unsharded one."""
    def finding(run):
        return state_finding(run.reports, run.full_bytes, run.model_bytes, PROBLEM, "over", run.calibration)

    run = measured(ranks, world_size, repetition)
    findings(*judged(run, lambda: run_sharded_optimizer(ranks, world_size, MEASURED), finding,
                     lambda run: inside_state(run.reports, run.full_bytes, "over")), run.mismatch)


def test_every_rank_keeps_its_share(ranks, repetition):
    """handout: "these parameters will be sharded across all the ranks": at world size 3, every
    rank holds a share of the optimizer state, at least a third of 1/world size (its memory read
    from outside; a partition written for 2 ranks leaves the third without), and it still trains
    as the unsharded one."""
    def finding(run):
        return state_finding(run.reports, run.full_bytes, run.model_bytes, PROBLEM, "under", run.calibration)

    run = measured(ranks, 3, repetition)
    findings(*judged(run, lambda: run_sharded_optimizer(ranks, 3, MEASURED), finding,
                     lambda run: inside_state(run.reports, run.full_bytes, "under")), run.mismatch)
