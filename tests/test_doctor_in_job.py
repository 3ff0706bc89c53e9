"""The doctor inside the user's own job (cs336_systems/doctor/in_job.py, callback.py) finds each
planted fault of tests/doctor_job_cases.py, in a plain loop and in Lightning, and says nothing on
a healthy job. One launch of 2 gloo ranks runs every job."""

from __future__ import annotations

import pytest

from cs336_systems.launch import launch
from tests.doctor_job_cases import (DIVERGES, HEALTHY, LIGHTNING_JOBS, NO_SAMPLER, PLAIN_JOBS, SKIPS_STEPS,
                                    STRAGGLER, run_doctor_jobs)

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(300), pytest.mark.xdist_group("doctor-in-job")]

# What each fault must make the doctor say (a phrase of its finding), and nothing else.
EXPECTED = {
    NO_SAMPLER: ["rank 1 draws batches with SequentialSampler, not a DistributedSampler",
                 "different numbers of batches per epoch (rank 0: 4, rank 1: 8)"],
    SKIPS_STEPS: ["stepped their optimizers different numbers of times in 3 batches (rank 0: 3, rank 1: 2)",
                  "rank 1's parameters differ from rank 0's"],
    DIVERGES: ["rank 1's parameters differ from rank 0's in 1 of 4 (first: ",
               "after the first optimizer step"],
    STRAGGLER: ["rank 1 is a straggler"],
}
JOBS = [f"plain-{f}" for f in PLAIN_JOBS] + [f"lightning-{f}" for f in LIGHTNING_JOBS]
_runs: dict[str, list[dict]] = {}


def _findings() -> list[dict[str, list[str]]]:
    if "ranks" not in _runs:
        _runs["ranks"] = launch(run_doctor_jobs, 2, timeout_s=120)
    return _runs["ranks"]


@pytest.mark.parametrize("job", JOBS)
def test_finds_the_planted_fault_and_nothing_else(job: str):
    fault = job.split("-", 1)[1]
    per_rank = [ranks[job] for ranks in _findings()]
    assert per_rank[0] == per_rank[1], "every rank judges alike"
    found = per_rank[0]
    if fault == HEALTHY:
        assert found == [], found
        return
    expected = EXPECTED[fault]
    assert len(found) == (2 if fault == NO_SAMPLER else 1 + (fault == SKIPS_STEPS)), found
    text = " | ".join(found)
    for phrase in expected:
        assert phrase in text, (phrase, found)
