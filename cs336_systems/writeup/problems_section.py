"""The map of the handout's problems (where each is answered in code and by tests), and the code answers.

Problems come from :mod:`cs336_systems.problems`; test status from the grade table ``make test``
writes (results kind "grades"), the newest such file when several machines ran the tests.
"""

from __future__ import annotations

from cs336_systems.problems import CODE, MEASURED, PROBLEMS, WRITTEN, GradeRecord
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.load import ResultsFile

ANSWERED_BY = {
    CODE: "code, graded by tests",
    MEASURED: "code, a benchmark and its answer",
    WRITTEN: "analysis, in its answer",
}


def _latest_grades(ctx: RenderContext) -> ResultsFile | None:
    runs = [results for _, results in ctx.inputs.runs(GradeRecord.KIND)]
    return max(runs, key=lambda r: r.environment.timestamp_utc, default=None)


# Section 8's answers: their formulas are read back against the capacity library, which its tests check.
FORMULA_CHECKS = "its formulas read back by `tests/test_writeup_formulas*.py` against `cs336_systems/capacity/`, " \
                 "which `tests/test_parallelism.py` checks"


def _status(grade: GradeRecord | None, deliverable: str = CODE, where: tuple[str, ...] = ()) -> str:
    """The tests' count, and for a measured or written problem that its answer is not auto-graded."""
    text = "no tests"
    if grade is not None and grade.total:
        text = f"{grade.passed}/{grade.total} passed" + (f", {grade.skipped} skipped" if grade.skipped else "")
    if deliverable == MEASURED:
        return ("code: " + text if text != "no tests" else "code: no tests") + "; written answer not auto-graded"
    if deliverable == WRITTEN:
        checked = any("capacity/strategies.py" in w for w in where)
        return "not auto-graded (a written answer)" + (f"; {FORMULA_CHECKS}" if checked else "")
    return text


# The reliability tests, and what one of their cases is (cs336_systems/launch/README.md, "Reliability").
RELIABILITY = (
    ("tests/test_bad_inputs.py", "bad values fed to the flags of every script (each must exit 2 with one line "
                                 "naming the flag, before any process starts)"),
    ("tests/test_signals.py", "faults injected into running 2-rank jobs (SIGTERM to a background launcher, Ctrl-C, "
                              "SIGKILL, SIGTERM to torchrun, an interrupted suite; each asserts no process of the "
                              "job is left 10 s later and no results file is written)"),
    ("tests/test_ddp_buffers.py", "BatchNorm runs compared with torch's DDP, buffer broadcast on and off"),
    ("tests/test_ddp_host_waits.py", "steady-state steps counted for host-device waits (0 allowed)"),
)


def _reliability(beyond: GradeRecord) -> list[str]:
    lines = []
    for path, what in RELIABILITY:
        if path in beyond.files:
            passed, total = beyond.files[path]
            lines.append(f"- `{path}`: {total} {what}: {passed} of {total} passed.")
    return lines


def grading_page(ctx: RenderContext) -> Page:
    """The problem map and the grade table; the answer to each problem whose deliverable is code."""
    grades_file = _latest_grades(ctx)
    grades = {g.problem: g for g in grades_file.records} if grades_file else {}
    rows = []
    for p in PROBLEMS:
        grade = grades.get(p.name)
        tests = ", ".join(f"`{f}`" for f in sorted(grade.files)) if grade and grade.files else "–"
        rows.append([f"[`{p.name}`](../README.md#{p.name})", p.points, p.edition, ANSWERED_BY[p.deliverable],
                     ", ".join(f"`{w}`" for w in p.where), tests, _status(grade, p.deliverable, p.where)])
    beyond = grades.get("beyond")
    # The grade lines name the run they come from: grades.json is refreshed only by `make test`.
    ran = f"`make test` at {fmt.commit(grades_file.environment)}" if grades_file else "`make test`"
    setting = None
    if grades_file is not None:
        setting = fmt.setting_line(grades_file.environment, grades_file.source,
                                   parts=[f"`make test` ({' '.join(grades_file.setting.get('pytest_args', []))})"])
    markdown = templating.render(
        "details/grading.md.j2", ran=ran,
        table=fmt.table(["problem", "points", "edition", "answered by", "code", "tests", "status"], rows,
                        align="lrlllll"),
        setting=setting, beyond=_status(beyond) if beyond else None,
        reliability=_reliability(beyond) if beyond else [],
        failing=[t for g in grades.values() for t in g.failed])
    answers = {
        p.name: templating.render("answers/code.md.j2", problem=p, grade=grades.get(p.name),
                                  status=_status(grades.get(p.name)), measured=grades_file is not None, ran=ran,
                                  link=details_link("grading"))
        for p in PROBLEMS if p.deliverable == CODE
    }
    return Page("grading", markdown, answers)
