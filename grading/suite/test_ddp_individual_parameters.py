"""ddp_overlap_individual_parameters: DDP that all-reduces each gradient as soon as it is ready.

Every test trains through the submission's adapters on every rank beside single-process
training (grading/cases.py). Beyond the public tests: world size 3, ranks that start from
weights no seed reproduces, AdamW, tied weights, a layer no rank uses, every rank checked at
every step, and communication that must start while backward still runs.
"""

import pytest

from grading.cases import DDPCase, train_ddp
from grading.suite.conftest import EDITION

pytestmark = pytest.mark.problem("ddp_overlap_individual_parameters")

ADAPTERS = {"2025": ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward"),
            "2026": ("get_ddp", "ddp_on_after_backward")}
NAMES = [ADAPTERS[e] for e in (("2025", "2026") if EDITION == "both" else (EDITION,))]
IDS = [names[0] for names in NAMES]


@pytest.fixture(params=NAMES, ids=IDS)
def case(request) -> DDPCase:
    return DDPCase(*request.param)


def test_matches_single_process(ranks, case):
    ranks(train_ddp, 2, case)


def test_three_ranks(ranks, case):
    ranks(train_ddp, 3, case)


def test_adamw(ranks, case):
    ranks(train_ddp, 2, DDPCase(case.get, case.after_backward, optimizer="adamw"))


def test_tied_weights(ranks, case):
    ranks(train_ddp, 2, DDPCase(case.get, case.after_backward, model="tied"))


def test_unused_layer(ranks, case):
    ranks(train_ddp, 2, DDPCase(case.get, case.after_backward, model="unused"))


def test_communicates_during_backward(ranks, case):
    results = ranks(train_ddp, 2, case)
    during = [r["during_backward"] for r in results]
    assert all(n > 0 for per_rank in during for n in per_rank), (
        f"no all-reduce was issued while backward ran (per rank and step: {during}): gradients must be "
        "communicated as they become ready, not after backward")
