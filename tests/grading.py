"""The grade table printed at the end of ``make test``: tests passed and points per problem.

``make test`` collects the hidden-style suite (grading/suite, the one ``make grade`` runs on a
student's submission) on this checkout, beside this repository's own tests, so the two share one
suite and cannot drift.

Each test names the handout problem it grades with ``@pytest.mark.problem("<name>")``. The
public CS336 test files carry no marker, so they are recognised by file name. Points are the
handout's (cs336_systems/problems.py: spring 2025 section 2, and the 2026 edition's FSDP); a
problem earns its points in proportion to the tests it passed, and one with no tests earns
nothing. With ``--grades-out PATH`` (``make test`` passes it) the table is also written as a
results file of kind "grades", which the writeup's map of problems reads.

Works under pytest-xdist: workers attach the problem to each report's ``user_properties``,
which travel to the controller that prints the table.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from cs336_systems.problems import TESTED_POINTS, GradeRecord
from cs336_systems.launch import default_device_type
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path

PROBLEM_POINTS = TESTED_POINTS  # the handout's points of every problem the tests grade
BEYOND = "beyond"  # our own additions: graded for pass/fail, no handout points
PUBLIC_TEST_FILES = {
    "test_ddp_individual_parameters.py": "ddp_overlap_individual_parameters",
    "test_ddp.py": "ddp_overlap_bucketed",
    "test_sharded_optimizer.py": "optimizer_state_sharding",
    "test_fsdp.py": "fsdp",  # the 2026 suite's FSDP tests
}
UNMARKED = "(no problem marker)"


def problem_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("problem")
    if marker is not None:
        name = marker.args[0]
        if name not in PROBLEM_POINTS and name != BEYOND:
            raise pytest.UsageError(f"{item.nodeid}: unknown problem {name!r}")
        return name
    return PUBLIC_TEST_FILES.get(item.path.name, UNMARKED)


class GradeReport:
    def __init__(self, grades_out: str | None = None) -> None:
        self.grades_out = grades_out
        self.problem: dict[str, str] = {}
        self.failed: set[str] = set()
        self.passed: set[str] = set()
        self.skipped: set[str] = set()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            item.user_properties.append(("problem", problem_of(item)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        problem = dict(report.user_properties).get("problem")
        if problem is None:
            return
        self.problem[report.nodeid] = problem
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.skipped:
            self.skipped.add(report.nodeid)
        elif report.when == "call":
            self.passed.add(report.nodeid)

    def records(self) -> list[GradeRecord]:
        failed: dict[str, list[str]] = defaultdict(list)
        files: dict[str, dict[str, list[int]]] = defaultdict(dict)
        for nodeid in sorted(self.failed):
            failed[self.problem[nodeid]].append(nodeid)
        for nodeid, problem in sorted(self.problem.items()):
            if nodeid in self.skipped and nodeid not in self.failed:
                continue
            counts = files[problem].setdefault(nodeid.split("::")[0], [0, 0])
            counts[0] += nodeid in self.passed and nodeid not in self.failed
            counts[1] += 1
        return [
            GradeRecord(name, ok, total, skipped, earned if name in PROBLEM_POINTS else None,
                        int(possible) if name in PROBLEM_POINTS else None, files[name], failed[name])
            for name, ok, total, skipped, earned, possible in self.rows()
        ]

    def rows(self) -> list[tuple[str, int, int, int, float, float]]:
        """(problem, passed, total, skipped, points earned, points possible) per problem."""
        passed, total, skipped = defaultdict(int), defaultdict(int), defaultdict(int)
        for nodeid, problem in self.problem.items():
            if nodeid in self.skipped and nodeid not in self.failed:
                skipped[problem] += 1
                continue
            total[problem] += 1
            if nodeid in self.passed and nodeid not in self.failed:
                passed[problem] += 1
        names = list(PROBLEM_POINTS) + sorted(set(total) - set(PROBLEM_POINTS))
        out = []
        for name in names:
            possible = float(PROBLEM_POINTS.get(name, 0))
            earned = possible * passed[name] / total[name] if total[name] else 0.0
            out.append((name, passed[name], total[name], skipped[name], earned, possible))
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.problem:
            return
        rows = self.rows()
        tr = terminalreporter
        tr.section("grade report")
        tr.write_line(f"{'problem':<48} {'tests':>9} {'skipped':>8} {'points':>12}")
        for name, ok, total, skipped, earned, possible in rows:
            points = f"{earned:.1f}/{possible:.0f}" if name in PROBLEM_POINTS else "-"
            tr.write_line(f"{name:<48} {f'{ok}/{total}':>9} {skipped:>8} {points:>12}")
        earned = sum(r[4] for r in rows)
        possible = sum(r[5] for r in rows)
        ok = sum(r[1] for r in rows)
        total = sum(r[2] for r in rows)
        tr.write_line(f"{'total':<48} {f'{ok}/{total}':>9} {'':>8} {f'{earned:.1f}/{possible:.0f}':>12}")
        if self.grades_out and not hasattr(terminalreporter.config, "workerinput"):
            self._write(terminalreporter)

    def _write(self, terminalreporter) -> None:
        """The grade table as a results file, from the controller only (xdist workers see part)."""
        path = results_path(GradeRecord.KIND) if self.grades_out == "auto" else Path(self.grades_out)
        environment = collect_environment("gloo", 1, default_device_type())
        args = [str(a) for a in terminalreporter.config.invocation_params.args]
        write_results(path, ResultsFile(GradeRecord.KIND, environment, {"pytest_args": args}, self.records()))
        terminalreporter.write_line(f"grade table written to {path}")
