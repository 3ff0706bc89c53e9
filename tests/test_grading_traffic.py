"""What FSDP carries between ranks, judged from outside them (grading/readings/traffic.py, grading/readings/carried.py).

The grader reads the bytes the loopback of the run's own network namespace sent, while every rank
is held before forward, between forward and backward and after backward, and holds them against
gloo's own collectives measured in the same set-up. The answers' FSDP (reduce-scatter, cast before
the all-gather) and equivalent variants (padded shards, no prefetch) lose nothing; the answers
with the weights cast after the all-gather lose exactly the new test's bfloat16 run, with the
handout's words. The answers with the gradients all-reduced instead of reduce-scattered keep
their points: gloo's reduce-scatter carries what its all-reduce carries, and the bytes cannot
tell them apart. Overlap: issue 38's forgery (all-reduces of zeros during backward, the average
after) fails test_communicates_during_backward from outside; the answers pass. Without a
namespace of its own the FSDP test is not run, and grade.md says so.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grading.readings import carried
from grading.isolation import student
from grading.harness import NOT_CHECKED, grade, namespaces_available
from tests import grading_session
from tests.grading_session import Settings
from tests.test_grading import BUCKETED, FSDP, PER_PARAMETER, QUICK, failures, make_submission

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parents[1]

TEST = "test_gradients_are_reduce_scattered"
# the new test beside the two whose values a wrong cast or sum would change: the mutants keep them
SELECT = f"{TEST} or test_compute_dtype or test_adamw"
needs_namespaces = pytest.mark.skipif(not namespaces_available(), reason="the grader cannot make network namespaces here")


def failed(graded) -> list[str]:
    return sorted(t.name.removeprefix("test_fsdp.py::") for t in graded.tests if not t.passed and not t.beyond)


@needs_namespaces
def test_equivalent_fsdp_keeps_every_point(tmp_path):
    """Padded shards and no prefetch at once (the answers themselves: test_grading.py's
    test_correct_fsdp_gets_every_point, which runs this test in namespace mode)."""
    graded = grade(make_submission(tmp_path, "padded_shards+no_prefetch"), tmp_path / "out", 1, "2026", QUICK,
                   quiet=True, only=(FSDP,), select=SELECT)
    assert failed(graded) == [], failures(graded, FSDP)
    assert sum(TEST in t.name for t in graded.tests) == 3
    assert next(r.points for r in graded.rows if r.problem == FSDP) == 15.0


# The three mutants are graded in one pass of a folder per session (tests/grading_session.py).
CARRIES = Settings("2026", QUICK, only=(FSDP,), select=f"{TEST} or test_compute_dtype")
for _mutant in ("casts_after_gather", "skips_holds", "all_reduces_gradients"):
    grading_session.fixture(f"traffic-{_mutant}", functools.partial(make_submission, mutant=_mutant), CARRIES)


@needs_namespaces
@pytest.mark.parametrize("mutant, lost, words", [pytest.param(*case, marks=grading_session.graded_fixture(f"traffic-{case[0]}"))
                                                 for case in [
    ("casts_after_gather", [f"{TEST}[2-bfloat16]"],
     'the weights were all-gathered in float32, not cast to bfloat16 before (the handout: "When compute_dtype'),
    ("skips_holds", [f"{TEST}[2-bfloat16]", f"{TEST}[2]", f"{TEST}[3]"],
     "the loopback's bytes could not be attributed to forward and backward: the ranks held at []"),
    # gloo's reduce-scatter carries what its all-reduce carries (grading/readings/carried.py: SCATTER_TELLS):
    # the bytes cannot tell them apart, and this mutant keeps its points. Should gloo change, this fails.
    ("all_reduces_gradients", [], ""),
]])
def test_fsdp_that_carries_too_much_loses_the_tests_share(session_gradings, mutant, lost, words):
    result = session_gradings.result(f"traffic-{mutant}")
    graded = result.graded
    assert failed(graded) == lost, failures(graded, FSDP)
    lines = failures(graded, FSDP)
    assert all(words in line and "\n" not in line for line in lines), lines
    kept = sum(t.max_score for t in graded.tests if t.passed and not t.beyond)
    assert next(r.points for r in graded.rows if r.problem == FSDP) == pytest.approx(kept)
    assert NOT_CHECKED not in result.grade_md.read_text()


@needs_namespaces
@pytest.mark.skipif(os.environ.get("FORGERIES") != "all", reason="a race by design: FORGERIES=all runs it")
def test_a_rank_woken_while_held_gains_nothing(tmp_path):
    """A child that wakes its rank (SIGCONT) every millisecond: a hold it disturbs (woken while
    read, or never seen stopped) is read as no hold, and the run loses the test with that reason; one it misses (a loaded machine may not
    run the child in time) is read whole, and the FSDP, otherwise the answers', passes. So which
    runs it loses depends on the scheduler (outside make test, which must not race), never that a
    disturbed reading is attributed (test_holds_that_are_not_the_suites_attribute_nothing)."""
    graded = grade(make_submission(tmp_path, "wakes_itself"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(FSDP,), select=f"{TEST} or test_compute_dtype")
    runs = {f"{TEST}[2-bfloat16]", f"{TEST}[2]", f"{TEST}[3]"}
    assert set(failed(graded)) <= runs, failures(graded, FSDP)
    words = "the loopback's bytes could not be attributed to forward and backward: hold '"
    assert all(words in line for line in failures(graded, FSDP)), failures(graded, FSDP)
    kept = sum(t.max_score for t in graded.tests if t.passed and not t.beyond)
    assert next(r.points for r in graded.rows if r.problem == FSDP) == pytest.approx(kept)


def test_without_namespaces_the_traffic_is_not_checked(tmp_path):
    """As Gradescope's containers grade (root, no namespaces: tests/fallback_grade.py): the test is
    not collected, the other tests share its points, and grade.md says what was not checked."""
    if not student.can_switch() or shutil.which("unshare") is None:
        pytest.skip("the fallback as root needs root")
    args = {"submission": str(make_submission(tmp_path)), "out": str(tmp_path / "out"), "edition": "2026",
            "only": [FSDP], "select": f"{TEST} or test_adamw", "test_timeout_s": QUICK.test_timeout_s,
            "submission_timeout_s": QUICK.submission_timeout_s}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m",
                           "tests.fallback_grade", json.dumps(args)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (graded,) = json.loads(done.stdout.strip().splitlines()[-1]).values()
    assert graded["points"] == {FSDP: 15.0} and graded["runs"] == [1], graded
    assert NOT_CHECKED in (tmp_path / "out" / "grade.md").read_text()


def test_holds_that_are_not_the_suites_attribute_nothing():
    """A reading is attributed only when every hold is the suite's, in order, and none failed."""
    labels = carried.fsdp_labels(1)
    right = [{"label": label, "bytes": b} for label, b in zip(labels, (100, 300, 800))]
    assert carried.phases(right, labels) == [200, 500]
    assert "where the suite holds at" in carried.phases(right[::-1], labels)
    assert "where the suite holds at" in carried.phases(right[:2], labels)
    woken = [*right[:2], {"label": labels[2], "error": "a rank was woken while the grader held it"}]
    assert carried.phases(woken, labels) == f"hold {labels[2]!r}: a rank was woken while the grader held it"


def test_finding_names_the_phase_its_bytes_and_limits():
    """In calibrated units (gather = reduce-scatter = 1, all-reduce = 2 per byte, as a ring at two
    ranks): a backward of gather + all-reduce is over the halfway limit, of gather + reduce-scatter
    under it; a forward in float32 with a half-size compute dtype is over its limit, one that
    prefetches backward's gathers in that dtype is not."""
    calibration = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
    labels = carried.fsdp_labels(2)

    def finding(forward: int, backward: int, dtype: str | None = None) -> str:
        """Step 1 (not judged: lazy set-up) carries anything; step 2 ``forward`` and ``backward``."""
        counts = (0, 9000, 9000, 9500, 9500 + forward, 9500 + forward + backward)
        reports = [{"traffic": [{"label": label, "bytes": b} for label, b in zip(labels, counts)]}]
        return carried.fsdp_finding(reports, calibration, 1000, dtype, 2)

    assert finding(1000, 2000) == ""
    assert "all-reduced, not reduce-scattered" in finding(1000, 3000)
    assert finding(500, 1500, "bfloat16") == ""
    assert "not cast to bfloat16 before" in finding(1000, 2000, "bfloat16")
    # a public student's FSDP prefetches two of backward's gathers during forward, in bfloat16:
    # its forward carries 1.5 gathers in bfloat16, its step what a right one does
    assert finding(750, 1250, "bfloat16") == ""
    # gathered in float32 in forward and never again (backward only reduces): caught by forward alone
    assert "not cast to bfloat16 before" in finding(1000, 1000, "bfloat16")
    assert "not all-gathered" in finding(0, 2000)
    assert "did not leave the rank" in finding(1000, 100)
    calibration.update(reduce_scatter=2.0)  # gloo's: as much as an all-reduce
    assert finding(1000, 3000) == ""
    assert "the gradients were sent more than once" in finding(1000, 5000)


OVERLAP = "test_communicates_during_backward"


@needs_namespaces
@pytest.mark.parametrize("mutant, edition, problem, test", [
    ("zeros_during_backward", "2026", PER_PARAMETER, f"test_ddp_individual_parameters.py::{OVERLAP}[get_ddp]"),
    ("zeros_during_backward_bucketed", "2025", BUCKETED, f"test_ddp_bucketed.py::{OVERLAP}"),
])
def test_overlap_is_judged_by_the_bytes_carried(tmp_path, mutant, edition, problem, test):
    """Issue 38's forgery (asynchronous all-reduces of zeros as large as the gradients during
    backward, the average one blocking all-reduce after) passes the probe inside the rank, and
    fails from outside: the step carried the gradients twice; training is right, so nothing else
    is lost. (The answers pass in namespace mode: test_grading.py's correct submissions.)"""
    graded = grade(make_submission(tmp_path, mutant), tmp_path / "out", 1, edition, QUICK, quiet=True,
                   only=(problem,), select=f"{OVERLAP} or test_three_ranks")
    lost = [t.name for t in graded.tests if not t.passed and not t.beyond]
    assert lost == [test], failures(graded, problem)
    (line,) = failures(graded, problem)
    assert "they were sent again after" in line and "the handout" in line and "; also:" not in line, line
