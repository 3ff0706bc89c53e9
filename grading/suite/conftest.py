"""Which tests run for the graded edition, each test's problem, and the hang rule.

``GRADING_EDITION`` ("2025", "2026" or "both"; the harness sets it from the adapters file) picks
the problems and the adapter names. A test marked ``loopback`` reads the bytes the ranks carried
(grading/readings/traffic.py) and runs only where the grader has a network namespace of its own;
elsewhere it is not collected, and its problem's other tests share its points (report.py). A
problem whose test timed out runs none of its remaining tests: a deadlock is nearly always the
implementation's, not the test's, and running on would cost a timeout per test (they fail at
once with the first one's reason instead).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grading.readings import traffic
from grading.readings.outside import return_freed_memory
from grading.problems import EDITIONS, GRADED
from grading.isolation.ranks import RankFailure, run_ranks

SUITE = Path(__file__).resolve().parent
EDITION = os.environ.get("GRADING_EDITION", "both")
if EDITION not in EDITIONS:
    raise pytest.UsageError(f"GRADING_EDITION must be one of {EDITIONS}, got {EDITION!r}")

ONLY = tuple(filter(None, os.environ.get("GRADING_PROBLEMS", "").split(",")))  # grade just these

return_freed_memory()  # the grader's own large blocks too: they must not pile up over a run

_hung: dict[tuple[str, int], str] = {}  # (problem, world size) -> the test that timed out first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items (``make test`` collects tests/ too): judge only ours.
    keep, drop = [], []
    for item in items:
        if SUITE not in item.path.parents:
            keep.append(item)
            continue
        marker = item.get_closest_marker("problem")
        chosen = marker is None or (marker.args[0] in GRADED[EDITION] and (not ONLY or marker.args[0] in ONLY))
        # the bytes on a loopback that other processes share are not the ranks': not checked there
        chosen = chosen and (item.get_closest_marker("loopback") is None or traffic.private())
        (keep if chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def ranks(request: pytest.FixtureRequest):
    """``ranks(fn, world_size, payloads)``: run a rank function (grading.suite.training) on the data the
    grader encoded for each rank; a failure fails the test in one line."""
    problem = request.node.get_closest_marker("problem").args[0]

    def run(fn, world_size: int, payloads: list[bytes], releases: dict[str, list[bytes]] | None = None):
        if (problem, world_size) in _hung:
            pytest.fail(f"not run: {_hung[problem, world_size]} timed out at world size {world_size}, and a hang "
                        "stops its problem's tests at that world size", pytrace=False)
        try:
            return run_ranks(fn, world_size, payloads, releases=releases)
        except RankFailure as failure:
            if failure.timed_out:
                _hung.setdefault((problem, world_size), request.node.originalname)
            pytest.fail(failure.reason, pytrace=False)

    return run


@pytest.fixture
def repetition(request: pytest.FixtureRequest) -> int:
    """Which repetition of its test this is (grading.reports.plugin's ``--grading-repeats``); 1 where the
    plugin is not loaded (``make test`` runs the suite on this checkout without it)."""
    callspec = getattr(request.node, "callspec", None)
    return callspec.params.get("grading_repetition", 1) if callspec is not None else 1
