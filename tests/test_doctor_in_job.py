"""The doctor inside the user's own job (cs336_systems/doctor/in_job.py, callback.py) finds each
planted fault of tests/doctor_job_cases.py, in a plain loop and in Lightning, and says nothing on
a healthy job. One launch of 2 gloo ranks runs every job."""

from __future__ import annotations

import time

import pytest

from cs336_systems.launch import launch
from cs336_systems.launch.spawn import RankFailedError
from tests.rank_pool import on_pool
from tests.doctor_job_cases import (DIVERGES, FSDP2_DIVERGES, FSDP2_HEALTHY, HEALTHY, LIGHTNING_JOBS, NO_SAMPLER,
                                    PLAIN_JOBS, REPORT_TIMEOUT_S, SKIPS_STEPS, SLOW_LOADER, STRAGGLER,
                                    UNEVEN_SAMPLES, run_doctor_jobs, skips_iteration_job)

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
    SLOW_LOADER: ["rank 1 waits for its data: at least "],
    UNEVEN_SAMPLES: ["different numbers of samples per step (batch 0: rank 0: 4, rank 1: 8)"],
    FSDP2_DIVERGES: ["rank 1's parameters differ from rank 0's in 1 of 4 (first: ",
                     "after the first optimizer step"],
}
SILENT = (HEALTHY, FSDP2_HEALTHY)
JOBS = [f"plain-{f}" for f in PLAIN_JOBS] + [f"lightning-{f}" for f in LIGHTNING_JOBS]
_runs: dict[str, list[dict]] = {}


def _findings() -> list[dict[str, list[str]]]:
    if "ranks" not in _runs:
        _runs["ranks"] = on_pool(run_doctor_jobs, 2, timeout_s=120)
    return _runs["ranks"]


@pytest.mark.parametrize("job", JOBS)
def test_finds_the_planted_fault_and_nothing_else(job: str):
    fault = job.split("-", 1)[1]
    per_rank = [ranks[job] for ranks in _findings()]
    assert per_rank[0] == per_rank[1], "every rank judges alike"
    found = per_rank[0]
    if fault in SILENT:
        assert found == [], found
        return
    expected = EXPECTED[fault]
    assert len(found) == (2 if fault == NO_SAMPLER else 1 + (fault == SKIPS_STEPS)), found
    text = " | ".join(found)
    for phrase in expected:
        assert phrase in text, (phrase, found)


@pytest.mark.timeout(120)
def test_a_rank_that_skips_an_iteration_ends_the_job_with_a_finding_naming_it():
    """Rank 1 skips an iteration: rank 0 waits in that iteration's all-reduce for ever, rank 1 in
    report(). The report's deadline ends the job (well within a minute) and names both."""
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=f"rank 0 did not reach report\\(\\) within {REPORT_TIMEOUT_S:g} s") as error:
        launch(skips_iteration_job, 2, timeout_s=120)
    assert time.monotonic() - start < 60
    text = str(error.value)
    assert "rank1 failed first" in text and "DoctorTimeout" in text, text
    assert "(last seen: rank 0: started batch 3 (2 optimizer steps))" in text, text
    assert ("arrived: rank 1 after 2 batches and 2 optimizer steps. Rank 1 ran fewer iterations than rank 0 "
            "started") in text, text
