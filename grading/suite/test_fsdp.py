"""fsdp (2026): Linear and Embedding weights sharded over ranks, gathered when used.

The grader chooses the initial weights and fills the submission's model with them before it is
wrapped (grading/suite/models.py), so a model whose own layers start at zero trains like any other.
Graded tests use leading dimensions that divide world sizes 2 and 3 (as the course's own tests
do since release 26.1.4); uneven shards are checked beyond the handout, for 0 points.
"""

import pytest

from grading.readings import carried
from grading.suite.checks import FSDPCase, findings, run_fsdp
from grading.readings.memory import freed_finding, inside_weights, judged, weights_finding
from grading.suite.models import LMShape

PROBLEM = "fsdp"
pytestmark = pytest.mark.problem(PROBLEM)


# The measured runs train with plain SGD: no optimizer state, so what a rank holds between steps
# is its shards (grading/readings/memory.py); two steps (the second's pause between forward and backward
# is judged against the first's end), on a model of 25 MiB. A run serves every check of its
# world size and repetition (reports are small: sampled parameters and readings).
MEASURED = FSDPCase(optimizer="public_sgd", steps=2, measure=True)


_measured: dict[tuple[int, int], object] = {}  # (world size, repetition) -> its run, for the next test to read too


def measured(ranks, world_size: int, repetition: int):
    """The measured run at ``world_size`` of this repetition: one run serves every check of it."""
    if (world_size, repetition) not in _measured:
        _measured[world_size, repetition] = run_fsdp(ranks, world_size, MEASURED)
    return _measured[world_size, repetition]


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size, repetition):
    """handout: training through the FSDP wrapper matches single-process training; the gathered
    full parameters equal the reference's after every step (SGD as the public tests train, on the
    measured model, a sample of every weight's values)."""
    measured(ranks, world_size, repetition).assert_matches()


def test_adamw(ranks):
    """handout: "Each shard of this container should be compatible with the standard AdamW
    implementation": the optimizer steps the sharded parameters only."""
    run_fsdp(ranks, 2, FSDPCase(optimizer="adamw")).assert_matches()


@pytest.mark.parametrize("compute_dtype", ["float16", "bfloat16"])
def test_compute_dtype(ranks, compute_dtype):
    """handout: "When compute_dtype is provided, cast the weights to that dtype before communicating
    or using them for compute, while keeping master weights and optimizer updates in FP32": as the
    public 26.1.4 tests, SGD(lr=0.01) against single-process training cast alike (within their
    1e-4, float16 and bfloat16), the model computing in that dtype, and every parameter and gradient the optimizer
    sees in float32."""
    run = run_fsdp(ranks, 2, FSDPCase(optimizer="public_sgd", compute_dtype=compute_dtype))
    output = run.reports[0]["output"]
    computed = "" if output == f"torch.{compute_dtype}" else (
        f"rank 0: the model's output is {output} with compute_dtype=torch.{compute_dtype} (the suite's model keeps "
        "its activations' dtype): the Linear and Embedding weights were not cast to it for compute")
    masters = ""
    for rank, report in enumerate(run.reports):
        wrong = {n: d for n, d in report["masters"].items() if d[0] != "torch.float32" or d[1] not in ("torch.float32", "")}
        if wrong and not masters:
            name, (param, grad) = next(iter(wrong.items()))
            masters = (f"rank {rank}: after fsdp_on_after_backward, parameter {name} is {param} with a {grad or 'no'} "
                       f"gradient: master weights and their gradients stay float32 ({len(wrong)} such)")
    findings(computed, run.mismatch, masters)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_are_sharded(ranks, world_size, repetition):
    """handout: "This leaves us with the embedding layer and every linear layer" to shard: each
    rank keeps 1/world size of each Linear and Embedding weight between steps (its memory read
    from outside, on a model whose four weights are of one size, so any one kept whole shows); it
    still trains as single-process training does."""
    def finding(run):
        return weights_finding(run.reports, run.weights, run.replicated, PROBLEM, run.calibration)

    run = measured(ranks, world_size, repetition)
    findings(*judged(run, lambda: run_fsdp(ranks, world_size, MEASURED), finding,
                     lambda run: inside_weights(run.reports, run.weights, run.replicated)), run.mismatch)


def test_gathered_weights_are_freed(ranks, repetition):
    """handout: "Make sure to free the gathered weights after use", and "In the backward pass, ...
    all-gather to have the weights available for the computation": between forward and backward a
    rank holds its shards, the activations and at most one gathered weight in flight (its memory
    read from outside). Autograd keeps a gathered weight that a matmul saved unless backward
    gathers it again (the answers do, with saved-tensor hooks: cs336_systems/answers/fsdp.py)."""
    def finding(run):
        return freed_finding(run.reports, run.weights, run.activations, PROBLEM)

    run = measured(ranks, 3, repetition)
    findings(*judged(run, lambda: run_fsdp(ranks, 3, MEASURED), finding, lambda run: None), run.mismatch)


@pytest.mark.loopback
@pytest.mark.parametrize("world_size, compute_dtype", [(2, None), (3, None), (2, "bfloat16")],
                         ids=["2", "3", "2-bfloat16"])
def test_gradients_are_reduce_scattered(ranks, world_size, compute_dtype):
    """handout: the FSDP wrapper "will handle weight all-gathers and gradient reduce-scatters", and
    "When compute_dtype is provided, cast the weights to that dtype before communicating": the bytes
    the ranks carried (the kernel's count for the run's own network namespace, read while the
    ranks are held before forward, between forward and backward, and after backward) fit an
    all-gather of the weights in the compute dtype in forward and one reduction of the gradients
    in backward, and the whole step (each step's batch sent only when the grader lets the ranks
    go from its "before forward" hold) its total; against gloo's own collectives at this world
    size (grading/readings/carried.py: gloo's reduce-scatter carries what its all-reduce carries, so the
    bytes do not tell them apart). It still trains as single-process training does."""
    run = run_fsdp(ranks, world_size, FSDPCase(optimizer="public_sgd", steps=3, compute_dtype=compute_dtype,
                                               traffic=True))
    calibration = carried.calibrate(ranks, world_size, [n // 4 for n in run.weights.values()])
    findings(carried.fsdp_finding(run.reports, calibration, sum(run.weights.values()), compute_dtype, 3), run.mismatch)


@pytest.mark.beyond_handout
def test_uneven_shards(ranks):
    """beyond the handout: dimensions that do not divide the world size (vocabulary 37 over 3 ranks)."""
    run_fsdp(ranks, 3, FSDPCase(shape=LMShape(vocab=37, d_model=20, d_ff=44))).assert_matches()
