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

from cs336_systems.problems import AUTO_GRADED_POINTS, TESTED_POINTS, GradeRecord
from grading.reports import report
from cs336_systems.launch import default_device_type
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path

# The handout's points of every problem the tests grade whole (code); a measured or written
# problem's row counts its tests but no points: no test grades its written answer.
PROBLEM_POINTS = AUTO_GRADED_POINTS
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
        if name not in TESTED_POINTS and name != BEYOND:
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
        self.beyond: set[str] = set()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            item.user_properties.append(("problem", problem_of(item)))
            item.user_properties.append(("beyond_handout", item.get_closest_marker("beyond_handout") is not None))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        problem = dict(report.user_properties).get("problem")
        if problem is None:
            return
        self.problem[report.nodeid] = problem
        if dict(report.user_properties).get("beyond_handout"):
            self.beyond.add(report.nodeid)
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.skipped:
            self.skipped.add(report.nodeid)
        elif report.when == "call":
            self.passed.add(report.nodeid)

    def _ran(self) -> dict[str, str]:
        """Tests that ran (not skipped), by node id -> problem."""
        return {n: p for n, p in sorted(self.problem.items()) if n not in self.skipped or n in self.failed}

    def records(self) -> list[GradeRecord]:
        """One record per problem with tests, then "beyond" (our own additions) and unmarked ones."""
        ran = self._ran()
        entries = []
        for nodeid, problem in ran.items():
            entries.append({"collected": nodeid, "problem": problem, "beyond": nodeid in self.beyond})
            entries.append({"test": nodeid, "problem": problem, "reason": "failed",
                            "passed": nodeid in self.passed and nodeid not in self.failed})
        scored = [p for p in PROBLEM_POINTS if p in ran.values()]
        tests = report.grade_tests(entries, scored, points=PROBLEM_POINTS)
        rows = {r.problem: r for r in report.problem_grades(tests, scored, points=PROBLEM_POINTS)}
        out = []
        for name in scored + sorted(set(ran.values()) - set(PROBLEM_POINTS)):
            mine = [n for n, p in ran.items() if p == name]
            files: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            for nodeid in mine:
                files[nodeid.split("::")[0]][0] += nodeid in self.passed and nodeid not in self.failed
                files[nodeid.split("::")[0]][1] += 1
            skipped = sum(1 for n, p in self.problem.items() if p == name and n in self.skipped and n not in self.failed)
            row = rows.get(name)
            out.append(GradeRecord(name, sum(v[0] for v in files.values()), len(mine), skipped,
                                   row.points if row else None, row.possible if row else None, dict(files),
                                   sorted(n for n in mine if n in self.failed)))
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.problem:
            return
        records = self.records()
        tr = terminalreporter
        tr.section("grade report")
        tr.write_line(f"{'problem':<48} {'tests':>9} {'skipped':>8} {'points':>12}")
        for r in records:
            points = "-" if r.points is None else f"{r.points:.1f}/{r.possible}"
            tr.write_line(f"{r.problem:<48} {f'{r.passed}/{r.total}':>9} {r.skipped:>8} {points:>12}")
        scored = [r for r in records if r.points is not None]
        tr.write_line(f"{'total':<48} {f'{sum(r.passed for r in records)}/{sum(r.total for r in records)}':>9} "
                      f"{'':>8} {f'{sum(r.points for r in scored):.1f}/{sum(r.possible for r in scored)}':>12}")
        if self.grades_out and not hasattr(terminalreporter.config, "workerinput"):
            self._write(terminalreporter)

    def _write(self, terminalreporter) -> None:
        """The grade table as a results file, from the controller only (xdist workers see part)."""
        path = results_path(GradeRecord.KIND) if self.grades_out == "auto" else Path(self.grades_out)
        environment = collect_environment("gloo", 1, default_device_type())
        args = [str(a) for a in terminalreporter.config.invocation_params.args]
        write_results(path, ResultsFile(GradeRecord.KIND, environment, {"pytest_args": args}, self.records()))
        terminalreporter.write_line(f"grade table written to {path}")
