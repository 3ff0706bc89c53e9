"""From test runs to grades: results.json (Gradescope's schema), grade.md, the console table, grades.csv.

A problem's points are split evenly over its tests; a test scores only if every repetition
passed, and one that passed some but not all is marked flaky, with its failure shown.
Gradescope's format: https://gradescope-autograders.readthedocs.io/en/latest/specs/ (top-level
``score`` and ``execution_time``; ``tests`` with ``name``, ``score``, ``max_score``, ``status``,
``output`` and ``tags``).
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from grading.problems import GRADED, POINTS, hand_graded


@dataclass(frozen=True)
class TestGrade:
    name: str  # file::test[params]
    problem: str
    runs: int
    passes: int
    reason: str  # the first failure's one line, "" when all passed
    max_score: float

    @property
    def passed(self) -> bool:
        return self.runs > 0 and self.passes == self.runs

    @property
    def flaky(self) -> bool:
        return 0 < self.passes < self.runs

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0

    @property
    def output(self) -> str:
        if self.passed:
            return f"passed {self.runs}/{self.runs} runs"
        if self.flaky:
            return f"flaky: passed {self.passes}/{self.runs} runs; failure: {self.reason}"
        return self.reason or "failed"


@dataclass(frozen=True)
class ProblemGrade:
    problem: str
    passed: int
    total: int
    flaky: int
    points: float | None  # None: graded by hand
    possible: int


def grade_tests(entries: list[dict], edition: str, notes: dict[str, str] | None = None,
                not_run: str = "not run", only: tuple[str, ...] | None = None) -> list[TestGrade]:
    """One grade per test from the plugin's JSON lines. A collected test that never ran fails with
    ``not_run``; a graded problem with no test at all (the suite could not start) gets one failed
    entry whose output is ``notes[problem]``."""
    by_test: dict[str, list[dict]] = defaultdict(list)
    per_problem: dict[str, list[str]] = defaultdict(list)
    for entry in entries:
        if "collected" in entry:
            per_problem[entry["problem"]].append(entry["collected"])
        elif not entry.get("skipped"):
            by_test[entry["test"]].append(entry)
    grades = []
    for problem in graded(edition, only):
        names = sorted(per_problem.get(problem, []))
        if not names:
            reason = (notes or {}).get(problem, not_run)
            grades.append(TestGrade(f"{problem} (not run)", problem, 1, 0, reason, float(POINTS[problem][0])))
            continue
        share = POINTS[problem][0] / len(names)
        for name in names:
            runs = by_test[name] or [{"passed": False, "reason": not_run}]
            failures = [e["reason"] for e in runs if not e["passed"]]
            grades.append(TestGrade(name, problem, len(runs), len(runs) - len(failures),
                                    failures[0] if failures else "", share))
    return grades


def graded(edition: str, only: tuple[str, ...] | None = None) -> list[str]:
    """The problems the suite grades in ``edition``, or those of them in ``only``."""
    return [p for p in GRADED[edition] if only is None or p in only]


def problem_grades(tests: list[TestGrade], edition: str, only: tuple[str, ...] | None = None) -> list[ProblemGrade]:
    rows = []
    for problem in graded(edition, only):
        mine = [t for t in tests if t.problem == problem]
        rows.append(ProblemGrade(problem, sum(t.passed for t in mine), len(mine), sum(t.flaky for t in mine),
                                 round(sum(t.score for t in mine), 6), POINTS[problem][0]))
    rows += [ProblemGrade(p, 0, 0, 0, None, POINTS[p][0]) for p in hand_graded(edition)]
    return rows


def table_lines(rows: list[ProblemGrade]) -> list[str]:
    """The grade table as text lines (the console and ``make test`` print these)."""
    lines = [f"{'problem':<48} {'tests':>7} {'flaky':>6} {'points':>12}"]
    for r in rows:
        if r.points is None:
            lines.append(f"{r.problem:<48} {'':>7} {'':>6} {f'by hand /{r.possible}':>12}")
        else:
            lines.append(f"{r.problem:<48} {f'{r.passed}/{r.total}':>7} {r.flaky:>6} "
                         f"{f'{r.points:.1f}/{r.possible}':>12}")
    auto = [r for r in rows if r.points is not None]
    lines.append(f"{'total (tested problems)':<48} {f'{sum(r.passed for r in auto)}/{sum(r.total for r in auto)}':>7} "
                 f"{sum(r.flaky for r in auto):>6} "
                 f"{f'{sum(r.points for r in auto):.1f}/{sum(r.possible for r in auto)}':>12}")
    return lines


def gradescope_results(tests: list[TestGrade], seconds: float, header: str) -> dict:
    return {
        "score": round(sum(t.score for t in tests), 4),
        "execution_time": round(seconds, 1),
        "output": header,
        "tests": [{"name": t.name, "score": round(t.score, 4), "max_score": round(t.max_score, 4),
                   "status": "passed" if t.passed else "failed", "output": t.output, "tags": [t.problem]}
                  for t in tests],
    }


def grade_markdown(name: str, header: str, rows: list[ProblemGrade], tests: list[TestGrade]) -> str:
    out = [f"# Grade: {name}", "", header, "", "| problem | tests passed | flaky | points |", "|---|---:|---:|---:|"]
    for r in rows:
        points = f"graded by hand (of {r.possible})" if r.points is None else f"{r.points:.1f} / {r.possible}"
        tests_cell = "" if r.points is None else f"{r.passed}/{r.total}"
        flaky = "" if r.points is None else str(r.flaky)
        out.append(f"| {r.problem} | {tests_cell} | {flaky} | {points} |")
    auto = [r for r in rows if r.points is not None]
    out.append(f"| **total (tested problems)** | {sum(r.passed for r in auto)}/{sum(r.total for r in auto)} | "
               f"{sum(r.flaky for r in auto)} | **{sum(r.points for r in auto):.1f} / {sum(r.possible for r in auto)}** |")
    failed = [t for t in tests if not t.passed]
    if failed:
        out += ["", "## Failed tests", ""]
        out += [f"- `{t.name}`: {t.output}" for t in failed]
    return "\n".join(out) + "\n"


def write_outputs(out: Path, name: str, header: str, tests: list[TestGrade], rows: list[ProblemGrade],
                  seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(gradescope_results(tests, seconds, header), indent=1) + "\n")
    (out / "grade.md").write_text(grade_markdown(name, header, rows, tests))


def write_csv(path: Path, graded: list[tuple[str, list[ProblemGrade]]]) -> None:
    """One row per submission, one column per problem the suite graded in any of them, and the total."""
    problems = [p for p in POINTS if any(r.problem == p and r.points is not None for _, rows in graded for r in rows)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["submission", *problems, "total"])
        for name, rows in graded:
            points = {r.problem: r.points for r in rows if r.points is not None}
            writer.writerow([name, *(f"{points[p]:.2f}" if p in points else "" for p in problems),
                             f"{sum(points.values()):.2f}"])
