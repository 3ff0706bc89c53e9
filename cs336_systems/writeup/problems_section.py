"""The map of the handout's problems: where each is answered in code, in this writeup and by tests.

Problems come from :mod:`cs336_systems.problems`; test status from the grade table ``make test``
writes (results kind "grades"), the newest such file when several machines ran the tests.
"""

from __future__ import annotations

from cs336_systems.problems import CODE, MEASURED, PROBLEMS, WRITTEN, GradeRecord
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.load import ResultsFile

ANSWERED_BY = {
    CODE: "code, graded by tests",
    MEASURED: "code, a benchmark and its section below",
    WRITTEN: "analysis, in its section below",
}


def _latest_grades(ctx: RenderContext) -> ResultsFile | None:
    runs = [results for _, results in ctx.inputs.runs(GradeRecord.KIND)]
    return max(runs, key=lambda r: r.environment.timestamp_utc, default=None)


def _status(grade: GradeRecord | None) -> str:
    if grade is None or grade.total == 0:
        return "no tests"
    text = f"{grade.passed}/{grade.total} passed"
    if grade.skipped:
        text += f", {grade.skipped} skipped"
    return text


# The reliability tests, and what one of their cases is (README.md, "Reliability").
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


def problems_section(ctx: RenderContext) -> Section:
    grades_file = _latest_grades(ctx)
    grades = {g.problem: g for g in grades_file.records} if grades_file else {}
    rows = []
    for p in PROBLEMS:
        grade = grades.get(p.name)
        section = f"`{p.name}` below" if p.deliverable in (MEASURED, WRITTEN) else "–"
        tests = ", ".join(f"`{f}`" for f in sorted(grade.files)) if grade and grade.files else "–"
        rows.append([f"`{p.name}`", p.points, p.edition, ANSWERED_BY[p.deliverable],
                     ", ".join(f"`{w}`" for w in p.where), section, tests, _status(grade)])
    out = [
        "## The handout's problems: where each is answered",
        "",
        "Every problem of the distributed part of CS336 assignment 2 (spring 2025, and the FSDP problems "
        "the 2026 edition adds), with the code that answers it, its section in this writeup, the tests "
        "that grade it and their status in the last `make test`.",
        "",
        fmt.table(["problem", "points", "edition", "answered by", "code", "section", "tests", "status"],
                  rows, align="lrllllll"),
    ]
    if grades_file is None:
        out += ["", "Test status: **not measured here**; `make test` writes the grade table this column reads."]
    else:
        beyond = grades.get("beyond")
        out += ["", fmt.setting_line(grades_file.environment, grades_file.source,
                                     parts=[f"`make test` ({' '.join(grades_file.setting.get('pytest_args', []))})"])]
        if beyond is not None:
            out += ["", f"Tests of what goes beyond the handout (launchers, signals, bad inputs, the doctor, the "
                        f"writeup itself): {_status(beyond)}.", "", *_reliability(beyond)]
        failing = [t for g in grades.values() for t in g.failed]
        if failing:
            out += ["", "Failing in that run: " + ", ".join(f"`{t}`" for t in failing) + "."]
    return Section("\n".join(out))
