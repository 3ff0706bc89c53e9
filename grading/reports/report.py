"""From test runs to grades: results.json (Gradescope's schema), grade.md, the console table, grades.csv.

A problem's points are split over its graded tests by its rubric (problems.toml: each test's
share, in units of 1/10^4 that sum to exactly the handout's points), and capped when a test of
what the problem is named for fails; a test scores only if every repetition passed, and one
that passed some but not all is marked flaky, with its failure shown. A test beyond the handout
is reported, worth 0.
``make test``'s grade table scores with the same functions (tests/grading.py).
Gradescope's format: https://gradescope-autograders.readthedocs.io/en/latest/specs/ (top-level
``score`` and ``execution_time``; ``tests`` with ``name``, ``score``, ``max_score``, ``status``,
``output`` and ``tags``).
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import platform
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from grading.problems import GRADED, POINTS, RUBRIC, test_function
from grading.readings.review import is_held

VISIBILITY = "visible"  # Gradescope: students see their results at once (or "after_published", ...)
STDOUT_VISIBILITY = "hidden"  # the console log names the grader's paths; staff read it, students read "output"
GRADE_RECORD = "grade.json"  # every row and test, to gather a folder's grades without grading again


@dataclass(frozen=True)
class TestGrade:
    name: str  # file::test[params]
    problem: str
    runs: int
    passes: int
    reason: str  # the first failure's one line, "" when all passed
    max_score: float
    beyond: bool = False  # a check beyond the handout: reported, worth 0
    requirement: str = ""  # what the handout asks that this test checks (its docstring)
    capped_score: float | None = None  # its part of the capped points, when the problem's cap applies
    capped: str = ""  # why: the cap and the failed test of what the problem is named for
    held: bool = False  # every failure a hold for review (review.py): counts as not passed, cap included, until a TA decides

    @property
    def passed(self) -> bool:
        return self.runs > 0 and self.passes == self.runs

    @property
    def flaky(self) -> bool:
        return 0 < self.passes < self.runs

    @property
    def score(self) -> float:
        if not self.passed:
            return 0.0
        return self.max_score if self.capped_score is None else self.capped_score

    @property
    def output(self) -> str:
        if self.passed and self.capped:
            return f"passed {self.runs}/{self.runs} runs; scores {self.score:g} of {self.max_score:g}: {self.capped}"
        if self.passed:
            return f"passed {self.runs}/{self.runs} runs"
        checks = f" [checks: {self.requirement}]" if self.requirement else ""
        if self.held:
            return f"{self.reason}{checks}"
        if self.flaky:
            return f"flaky: passed {self.passes}/{self.runs} runs; failure: {self.reason}{checks}"
        return f"{self.reason or 'failed'}{checks}"


@dataclass(frozen=True)
class ProblemGrade:
    problem: str
    passed: int
    total: int
    flaky: int
    points: float | None  # None: graded by hand
    possible: int
    beyond_passed: int = 0  # tests beyond the handout, worth 0
    beyond_total: int = 0
    capped: str = ""  # the cap that applied, and why
    held: float = 0.0  # what ``points`` would gain were its holds (review.py) released as passes: a TA decides


def shares(points: float, tests: int | list[float]) -> list[float]:
    """``points`` split over ``tests`` (a count: evenly; or weights: in proportion) in units of
    10^-4, the largest remainders rounded up: they sum exactly."""
    weights = [1.0] * tests if isinstance(tests, int) else tests
    total = round(points * 10_000)
    exact = [total * w / sum(weights) for w in weights]
    units = [int(u) for u in exact]
    for i in sorted(range(len(exact)), key=lambda i: (units[i] - exact[i], i))[:total - sum(units)]:
        units[i] += 1
    return [u / 10_000 for u in units]


def rubric_weights(problem: str, names: list[str]) -> list[float] | None:
    """Each graded test's weight by the problem's rubric (a function's share split evenly over
    its parameters), or None where the rubric does not cover them: a problem without one, or
    ``make test``'s table, which adds this repository's own tests (tests/...) to the suite's."""
    rubric = RUBRIC.get(problem)
    functions = [test_function(n) for n in names]
    if rubric is None or not names or any("/" in n.split("::")[0] or f not in rubric.shares for n, f in zip(names, functions)):
        return None
    return [rubric.shares[f] / functions.count(f) for f in functions]


def apply_cap(problem: str, tests: list[TestGrade], points: int) -> list[TestGrade]:
    """The problem's cap: when a test of what it is named for failed, for any reason (its own
    finding, wrong training, an exception, a timeout, a hold for review: a rank that recognised
    the test and raised there, or made its witnesses disagree, must not trade the cap for the
    test's share), the passed tests share at most the capped points, in proportion to their
    shares. A hold neither gives nor takes: until a TA decides it counts as not passed, and
    ``released`` says what releasing it would give."""
    rubric = RUBRIC.get(problem)
    graded_tests = [t for t in tests if not t.beyond]
    if rubric is None or rubric_weights(problem, [t.name for t in graded_tests]) is None:
        return tests
    missed = [t for t in graded_tests if test_function(t.name) in rubric.point and not t.passed]
    earned = sum(t.max_score for t in graded_tests if t.passed)
    limit = rubric.capped_points(points)
    if not missed or earned <= limit:
        return tests
    why = (f"{problem} is capped at {rubric.cap} of its points ({limit:g} of {points}): "
           f"{missed[0].name.split('::')[-1]}, a test of what the problem is named for, did not pass")
    passed = [t for t in graded_tests if t.passed]
    capped = dict(zip(map(id, passed), shares(limit, [t.max_score for t in passed])))
    return [replace(t, capped_score=capped[id(t)], capped=why) if id(t) in capped else t for t in tests]


def released(problem: str, tests: list[TestGrade], points: int) -> float:
    """The problem's points were every hold for review released as a pass (the cap applied again)."""
    freed = [replace(t, passes=t.runs, held=False, capped_score=None, capped="") if t.held
             else replace(t, capped_score=None, capped="") for t in tests]
    return round(sum(t.score for t in apply_cap(problem, freed, points) if not t.beyond), 4)


def grade_tests(entries: list[dict], problems: list[str], notes: dict[str, str] | None = None,
                not_run: str = "not run", points: dict[str, int] | None = None) -> list[TestGrade]:
    """One grade per test of ``problems`` from the plugin's JSON lines, split and capped by each
    problem's rubric. A collected test that never ran fails with ``not_run``; a problem with no
    test at all (the suite could not start) gets one failed entry whose output is ``notes[problem]``."""
    points = points or {p: POINTS[p][0] for p in problems}
    by_test: dict[str, list[dict]] = defaultdict(list)
    collected: dict[str, list[dict]] = defaultdict(list)
    for entry in entries:
        if "collected" in entry:
            collected[entry["problem"]].append(entry)
        elif not entry.get("skipped"):
            by_test[entry["test"]].append(entry)
    grades = []
    for problem in problems:
        tests = sorted(collected.get(problem, []), key=lambda e: e["collected"])
        graded_tests = [e for e in tests if not e.get("beyond")]
        mine = []
        if not graded_tests:
            reason = (notes or {}).get(problem, not_run)
            mine.append(TestGrade(f"{problem} (not run)", problem, 1, 0, reason, float(points[problem])))
        weights = rubric_weights(problem, [e["collected"] for e in graded_tests])
        split = iter(shares(points[problem], weights or len(graded_tests) or 1))
        for entry in tests:
            runs = by_test[entry["collected"]] or [{"passed": False, "reason": not_run}]
            failures = [e["reason"] for e in runs if not e["passed"]]
            mine.append(TestGrade(entry["collected"], problem, len(runs), len(runs) - len(failures),
                                  failures[0] if failures else "", 0.0 if entry.get("beyond") else next(split),
                                  bool(entry.get("beyond")), entry.get("requirement", ""),
                                  held=bool(failures) and all(is_held(f) for f in failures)))
        grades += apply_cap(problem, mine, points[problem])
    return grades


def graded(edition: str, only: tuple[str, ...] | None = None) -> list[str]:
    """The problems the suite grades in ``edition``, or those of them in ``only``."""
    return [p for p in GRADED[edition] if only is None or p in only]


def problem_grades(tests: list[TestGrade], problems: list[str], hand: list[str] = (),
                   points: dict[str, int] | None = None) -> list[ProblemGrade]:
    """A row per problem: graded tests passed, flaky, points (summed, rounded to 10^-4), and the
    tests beyond the handout apart; then the problems graded by hand."""
    points = points or {p: POINTS[p][0] for p in [*problems, *hand]}
    rows = []
    for problem in problems:
        mine = [t for t in tests if t.problem == problem and not t.beyond]
        beyond = [t for t in tests if t.problem == problem and t.beyond]
        rows.append(ProblemGrade(problem, sum(t.passed for t in mine), len(mine), sum(t.flaky for t in mine),
                                 round(sum(t.score for t in mine), 4), points[problem],
                                 sum(t.passed for t in beyond), len(beyond), next((t.capped for t in mine if t.capped), ""),
                                 round(released(problem, mine + beyond, points[problem]) - sum(t.score for t in mine), 4)
                                 if any(t.held for t in mine) else 0.0))
    rows += [ProblemGrade(p, 0, 0, 0, None, points[p]) for p in hand]
    return rows


def _beyond(r: ProblemGrade) -> str:
    return f"{r.beyond_passed}/{r.beyond_total}" if r.beyond_total else ""


def table_lines(rows: list[ProblemGrade]) -> list[str]:
    """The grade table as text lines (the console prints these); "beyond" counts the tests
    beyond the handout that passed (worth 0)."""
    lines = [f"{'problem':<48} {'tests':>7} {'flaky':>6} {'beyond':>7} {'points':>12}"]
    for r in rows:
        if r.points is None:
            lines.append(f"{r.problem:<48} {'':>7} {'':>6} {'':>7} {f'by hand /{r.possible}':>12}")
        else:
            lines.append(f"{r.problem:<48} {f'{r.passed}/{r.total}':>7} {r.flaky:>6} {_beyond(r):>7} "
                         f"{f'{r.points:.1f}/{r.possible}':>12}")
    auto = [r for r in rows if r.points is not None]
    lines.append(f"{'total (tested problems)':<48} {f'{sum(r.passed for r in auto)}/{sum(r.total for r in auto)}':>7} "
                 f"{sum(r.flaky for r in auto):>6} {'':>7} "
                 f"{f'{sum(r.points for r in auto):.1f}/{sum(r.possible for r in auto)}':>12}")
    return lines


@dataclass(frozen=True)
class Run:
    """How a submission was graded: what a regrade must repeat."""

    edition: str
    grader_commit: str
    repeats: int  # runs of each test
    only: tuple[str, ...] = ()  # a regrade of just these problems; () for all

    def regrade_command(self, submission: str, out: str) -> str:
        """The one line that grades ``submission`` again as this run did."""
        only = f' ONLY="{" ".join(self.only)}"' if self.only else ""
        return f"make grade SUBMISSION={submission} OUT={out} EDITION={self.edition} REPEATS={self.repeats}{only}"


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def student_output(rows: list[ProblemGrade], run: Run | None, notes: list[str] = ()) -> str:
    """What a student reads on Gradescope (Markdown): anything that stopped the submission from
    importing, the score per problem, how tests score, and the parts graded by hand."""
    auto = [r for r in rows if r.points is not None]
    lines = [*[f"**{note}**" for note in notes], *([""] if notes else [])]
    lines += ["| problem | tests passed | points |", "|---|---:|---:|"]
    lines += [f"| {r.problem} | {r.passed}/{r.total} | {r.points:.1f} / {r.possible} |" for r in auto]
    lines.append(f"| **total** | {sum(r.passed for r in auto)}/{sum(r.total for r in auto)} | "
                 f"**{sum(r.points for r in auto):.1f} / {sum(r.possible for r in auto)}** |")
    if run is not None:
        repeats = "once" if run.repeats == 1 else f"{run.repeats} times"
        lines += ["", f"Graded as the {run.edition} edition. Each test runs {repeats} and scores only if every run "
                  "passes; a failed test below says which requirement of the handout it checks and what was "
                  f"observed. Grader commit {run.grader_commit}: quote it in a regrade request."]
    hand = [r for r in rows if r.points is None]
    if hand:
        lines += ["", "Graded by hand from your writeup, not part of this score: "
                  + ", ".join(f"{r.problem} ({r.possible} point{'s' * (r.possible != 1)})" for r in hand) + "."]
    return "\n".join(lines)


def gradescope_results(tests: list[TestGrade], rows: list[ProblemGrade], seconds: float, run: Run | None,
                       notes: list[str] = ()) -> dict:
    """results.json in Gradescope's schema: every test with its own output; the student-facing
    summary in ``output``; the run's facts (grader commit, torch) in ``extra_data``."""
    return {
        "score": round(sum(t.score for t in tests), 4),
        "execution_time": round(seconds, 1),
        "output": student_output(rows, run, notes),
        "output_format": "md",
        "visibility": VISIBILITY,
        "stdout_visibility": STDOUT_VISIBILITY,
        "extra_data": {**(asdict(run) if run else {}), "torch": installed_version("torch"),
                       "python": platform.python_version()},
        "tests": [{"name": f"{t.name} (beyond the handout, 0 points)" if t.beyond else t.name,
                   "score": round(t.score, 4), "max_score": round(t.max_score, 4),
                   "status": "passed" if t.passed else "failed", "output": t.output, "tags": [t.problem]}
                  for t in tests],
    }


def grade_markdown(name: str, header: str, rows: list[ProblemGrade], tests: list[TestGrade],
                   notes: list[str] = ()) -> str:
    """The grade a TA reads: a line for anything that stopped the submission from importing,
    the table, every failed graded test with its reason and the requirement it checks, then
    the checks beyond the handout (worth 0)."""
    first, _, rest = header.partition("\n\n") if header.startswith("Guarantees") else ("", "", header)
    out = [f"# Grade: {name}", "", *([first, ""] if first else []), *[f"**{note}**" for note in notes],
           *([""] if notes else []), rest, "",
           "| problem | tests passed | flaky | beyond the handout (0 points) | points |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        points = f"graded by hand (of {r.possible})" if r.points is None else f"{r.points:.1f} / {r.possible}"
        points += f" (+{r.held:g} held for review)" if r.held else ""
        tests_cell = "" if r.points is None else f"{r.passed}/{r.total}"
        flaky = "" if r.points is None else str(r.flaky)
        out.append(f"| {r.problem} | {tests_cell} | {flaky} | {_beyond(r)} | {points} |")
    auto = [r for r in rows if r.points is not None]
    out.append(f"| **total (tested problems)** | {sum(r.passed for r in auto)}/{sum(r.total for r in auto)} | "
               f"{sum(r.flaky for r in auto)} |  | **{sum(r.points for r in auto):.1f} / {sum(r.possible for r in auto)}** |")
    if any(r.held for r in auto):
        total = sum(r.points for r in auto)
        out += ["", f"**Held for review:** {total:.1f} as graded (every hold counted as not passed, cap "
                    f"included); {total + sum(r.held for r in auto):.1f} if a TA releases every hold."]
    capped = [f"**Capped:** {r.capped}." for r in rows if r.capped]
    out += ["", *capped] if capped else []
    held = [t for t in tests if t.held and not t.beyond]
    if held:
        out += ["", "## Held for review", "",
                "The grader's witnesses disagree on these tests (grading/readings/review.py): they score nothing and cap "
                "nothing until a TA decides, from the evidence below and the code it names.", ""]
        out += [f"- `{t.name}` (up to {t.max_score:g}): {t.output}" for t in held]
    failed = [t for t in tests if not t.passed and not t.beyond and not t.held]
    if failed:
        out += ["", "## Failed tests", ""]
        out += [f"- `{t.name}` (−{t.max_score:g}): {t.output}" for t in failed]
    beyond = [t for t in tests if t.beyond]
    if beyond:
        out += ["", "## Beyond the handout (reported, 0 points)", ""]
        out += [f"- `{t.name}`: {'passed' if t.passed else t.output}" for t in beyond]
    rubric = rubric_lines([r.problem for r in rows if r.points is not None], {r.problem: r.possible for r in rows})
    if rubric:
        out += ["", "## Rubric (grading/problems.toml)", "", *rubric]
    return "\n".join(out) + "\n"


def rubric_lines(problems: list[str], points: dict[str, int]) -> list[str]:
    """Each problem's rubric in words: every graded test's share, and the cap."""
    lines = []
    for problem in problems:
        rubric = RUBRIC.get(problem)
        if rubric is None:
            continue
        split = ", ".join(f"{test} {share:g}" for test, share in rubric.shares.items())
        point = " and ".join(rubric.point)
        lines.append(f"- {problem} ({points[problem]} points): {split} (a test run at several parameters splits "
                     f"its share evenly). Named for {point}: a solution that fails it earns at most {rubric.cap} "
                     f"of the points ({rubric.capped_points(points[problem]):g}).")
    return lines


def write_outputs(out: Path, name: str, header: str, tests: list[TestGrade], rows: list[ProblemGrade],
                  seconds: float, notes: list[str] = (), run: Run | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = gradescope_results(tests, rows, seconds, run, list(notes))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "grade.md").write_text(grade_markdown(name, header, rows, tests, notes))
    record = {"name": name, "header": header, "notes": list(notes), "seconds": round(seconds, 1),
              "run": asdict(run) if run else None,
              "rows": [asdict(r) for r in rows], "tests": [asdict(t) for t in tests]}
    (out / GRADE_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def load_grade(out: Path) -> tuple[list[ProblemGrade], list[TestGrade], float]:
    """What ``write_outputs`` recorded in ``out``: a folder's rerun skips that submission."""
    record = json.loads((out / GRADE_RECORD).read_text())
    return ([ProblemGrade(**r) for r in record["rows"]], [TestGrade(**t) for t in record["tests"]],
            record["seconds"])


def load_run(out: Path) -> Run | None:
    """How the submission recorded in ``out`` was graded; None if unknown (no record, or older)."""
    try:
        run = json.loads((out / GRADE_RECORD).read_text()).get("run")
        return Run(run["edition"], run["grader_commit"], run["repeats"], tuple(run["only"])) if run else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_csv(path: Path, graded: list[tuple[str, list[ProblemGrade], str]]) -> None:
    """One row per submission: its edition (from its record beside ``path``, ``OUT/<name>/``),
    one column per problem the suite graded in any of them, the total, and a note saying why a
    submission has no grade (its job died)."""
    problems = [p for p in POINTS if any(r.problem == p and r.points is not None for _, rows, _ in graded for r in rows)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["submission", "edition", *problems, "total", "held for review", "note"])
        for name, rows, note in graded:
            points = {r.problem: r.points for r in rows if r.points is not None}
            run = load_run(path.parent / name)
            held = "; ".join(f"{r.problem} (+{r.held:g})" for r in rows if r.held)
            writer.writerow([name, run.edition if run else "", *(f"{points[p]:.2f}" if p in points else "" for p in problems),
                             f"{sum(points.values()):.2f}" if points else "", held, note])
