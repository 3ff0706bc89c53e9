"""What course staff read first after grading a folder: who got what, what failed and why.

``OUT/summary.md``: the run (grader commit, ``REPEATS``, wall time); a roster (each submission's
edition, total, a link to its ``grade.md`` and the one line that regrades it); per edition, how
many submissions got full, partial and no points on each problem, with the median; every test
that some submission failed, with how many and which; and per problem the most common causes
of lost points. A cause is the test (its function, whatever its parameters) and its finding:
the failure's line without where it happened (``rank 1, step 2:``, the student's ``file:line:``)
and without its numbers, so that ``rank 1, step 2: … by 0.031`` and ``rank 0, step 1: … by 0.02``
are one cause; each is counted once per student and shown with one example. A submission's
remarks (a git submodule not initialised, the other edition's adapters) appear in the roster
and in grades.csv's note, shortened to their first clause. ``OUT/summary.png``: per problem, how
many submissions got each score that occurs.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from grading.reports import report
from grading.harness import Graded, grader_commit

NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")
MOST_COMMON = 5
NAMED = 10  # submissions named per failed test; the rest are counted


@dataclass(frozen=True)
class Batch:
    """One grading of a folder: what the summary says about the run itself."""

    repeats: int
    wall_s: float
    sources: dict[str, Path] = field(default_factory=dict)  # submission name -> the checkout or zip graded
    skipped: int = 0  # graded by an earlier run (a rerun without REGRADE)


WHERE = re.compile(r"^(rank \d+(, step \d+)?:\s*)|^([\w./-]+\.py:\d+:\s*)")  # where, not what


def reason_key(output: str) -> str:
    """A failure's line without the requirement it checks and without its numbers."""
    return NUMBER.sub("N", output.split(" [checks:")[0]).strip()


def finding(output: str) -> str:
    """What a failure found, the same for every student who failed that way: its line without the
    requirement, without where (rank, step, the submission's file:line) and without numbers."""
    line = output.split(" [checks:")[0].strip()
    while (match := WHERE.match(line)) and match.end() > 0:
        line = line[match.end():].lstrip()
    return NUMBER.sub("N", line).strip()


def test_function(name: str) -> str:
    """``file::test[params]`` as ``test``: one cause, whichever parameters failed it."""
    return name.split("::")[-1].split("[")[0]


def short_remarks(g: Graded) -> str:
    """A submission's remarks for a table cell or grades.csv's note: each up to its first clause."""
    return "; ".join(re.split(r"[.;] ", remark, maxsplit=1)[0].rstrip(".") for remark in g.remarks)


def _total(g: Graded) -> tuple[float, int]:
    auto = [r for r in g.rows if r.points is not None]
    return sum(r.points for r in auto), sum(r.possible for r in auto)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def write(out: Path, graded: list[Graded], batch: Batch | None = None) -> None:
    runs = {g.name: report.load_run(out / g.name) for g in graded}
    editions = {name: run.edition if run else "unknown" for name, run in runs.items()}
    lines = [f"# Summary of {len(graded)} submissions", ""]
    lines += [_run_line(batch, runs), ""]
    died = [g for g in graded if g.note]
    if died:
        lines += [f"{len(died)} not graded (their job died): " + ", ".join(g.name for g in died), ""]
    lines += _roster(out, graded, runs, batch)
    lines += _held(graded)
    scores: dict[str, list[float]] = defaultdict(list)
    for edition in sorted(set(editions[g.name] for g in graded if not g.note)):
        mine = [g for g in graded if editions[g.name] == edition and not g.note]
        lines += ["", f"## Edition {edition}: {len(mine)} submission{'s' * (len(mine) != 1)}", ""]
        lines += _problem_table(mine, scores)
    lines += _failed_tests(graded)
    problems = list(dict.fromkeys(r.problem for g in graded for r in g.rows if r.points is not None))
    for problem in problems:
        lines += _reasons(graded, problem)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    possible = {r.problem: r.possible for g in graded for r in g.rows}
    shown = {p: sorted({editions[g.name] for g in graded for r in g.rows if r.problem == p and r.points is not None})
             for p in scores}
    _figure(out / "summary.png", scores, possible, shown)


def _run_line(batch: Batch | None, runs: dict[str, report.Run | None]) -> str:
    """The grader commit(s), REPEATS and wall time of the run that wrote this summary."""
    commits = sorted({run.grader_commit for run in runs.values() if run}) or [grader_commit()]
    parts = [f"Grader commit {', '.join(commits)}"]
    if batch is not None:
        parts.append(f"REPEATS={batch.repeats} (runs of each test; a test scores only if all pass)")
        parts.append(f"wall time {_minutes(batch.wall_s)}")
        if batch.skipped:
            parts.append(f"{batch.skipped} graded by an earlier run and kept (REGRADE=1 grades them again)")
    return "; ".join(parts) + "."


def _roster(out: Path, graded: list[Graded], runs: dict[str, report.Run | None], batch: Batch | None) -> list[str]:
    lines = ["## Roster", "", "| submission | edition | total | grade | regrade | note |", "|---|---|---:|---|---|---|"]
    for g in graded:
        run = runs[g.name]
        if g.note:
            lines.append(f"| {_cell(g.name)} |  |  | {_cell(g.note)} |  |  |")
            continue
        earned, possible = _total(g)
        source = (batch.sources.get(g.name) if batch else None) or Path("<folder>") / g.name
        command = run.regrade_command(str(source), str(out / g.name)) if run else ""
        lines.append(f"| {_cell(g.name)} | {run.edition if run else ''} | {earned:.1f} / {possible} | "
                     f"[grade.md]({g.name}/grade.md) | {f'`{command}`' if command else ''} | "
                     f"{_cell(short_remarks(g))} |")
    return lines


def _held(graded: list[Graded]) -> list[str]:
    """The problems held for review (review.py): a TA's queue, each with its grade.md's evidence."""
    rows = [(g, r) for g in graded if not g.note for r in g.rows if r.held]
    if not rows:
        return []
    lines = ["", "## Held for review", "", "The grader's witnesses disagree on these: the points are not in the "
             "total until a TA decides (each grade.md's \"Held for review\" has the evidence).", "",
             "| submission | problem | points held | first evidence |", "|---|---|---:|---|"]
    for g, r in rows:
        first = next((t.output for t in g.tests if t.held and t.problem == r.problem), "")
        lines.append(f"| [{_cell(g.name)}]({g.name}/grade.md) | {r.problem} | {r.held:g} | {_cell(first[:300])} |")
    return lines


def _problem_table(graded: list[Graded], scores: dict[str, list[float]]) -> list[str]:
    lines = ["| problem | points | full | partial | none | median |", "|---|---:|---:|---:|---:|---:|"]
    problems = list(dict.fromkeys(r.problem for g in graded for r in g.rows if r.points is not None))
    for problem in problems:
        rows = [r for g in graded for r in g.rows if r.problem == problem and r.points is not None]
        possible = rows[0].possible
        points = sorted(r.points for r in rows)
        scores[problem] += points
        full = sum(r.points >= possible for r in rows)
        none = sum(r.points == 0 for r in rows)
        lines.append(f"| {problem} | {possible} | {full} | {len(rows) - full - none} | {none} | "
                     f"{points[len(rows) // 2]:g} |")
    return lines


def _failed_tests(graded: list[Graded]) -> list[str]:
    """Every graded test some submission failed: how many, and which (the first NAMED)."""
    failed: dict[str, list[str]] = defaultdict(list)
    for g in graded:
        for t in g.tests:
            if not t.passed and not t.beyond:
                failed[t.name].append(g.name)
    if not failed:
        return []
    lines = ["", "## Failed tests", "", "| test | submissions | which |", "|---|---:|---|"]
    for test, names in sorted(failed.items(), key=lambda item: (-len(item[1]), item[0])):
        which = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
        lines.append(f"| `{_cell(test)}` | {len(names)} | {_cell(which)} |")
    return lines


def _reasons(graded: list[Graded], problem: str) -> list[str]:
    """The problem's most common causes of lost points (test and finding), by students."""
    students: dict[tuple[str, str], set[str]] = defaultdict(set)
    example: dict[tuple[str, str], str] = {}
    for g in graded:
        for t in g.tests:
            if t.problem != problem or t.passed or t.beyond:
                continue
            cause = (test_function(t.name), finding(t.output))
            students[cause].add(g.name)
            example.setdefault(cause, f"{g.name}: {t.output.split(' [checks:')[0]}")
    if not students:
        return []
    ranked = sorted(students, key=lambda c: (-len(students[c]), c))[:MOST_COMMON]
    lines = ["", f"## {problem}: most common causes of lost points", "",
             "| students | test | finding (one example) |", "|---:|---|---|"]
    return lines + [f"| {len(students[c])} | `{_cell(c[0])}` | {_cell(example[c])} |" for c in ranked]


def _cell(text: str) -> str:
    """A table cell: at most 300 characters, its pipes escaped."""
    return text[:300].replace("|", "\\|")


def _figure(path: Path, scores: dict[str, list[float]], possible: dict[str, int],
            editions: dict[str, list[str]]) -> None:
    """One bar per score that occurs (the count of submissions with it), per problem."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not scores:
        scores = {"no graded problem": []}
    fig, axes = plt.subplots(1, len(scores), figsize=(3.4 * len(scores), 2.8), squeeze=False)
    for ax, (problem, values) in zip(axes[0], scores.items()):
        top = possible.get(problem, 1)
        counts = Counter(values)
        xs = sorted(counts)
        ax.bar(xs, [counts[x] for x in xs], width=max(top / 40, 0.2), color="#4c72b0")
        ax.set_xlim(-top * 0.05, top * 1.05)
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7, rotation=90 if len(xs) > 6 else 0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        shown = editions.get(problem, [])
        ax.set_title(f"{problem.replace('_', ' ')}\nn = {len(values)}, edition{'s' * (len(shown) > 1)} "
                     f"{', '.join(shown) or 'none'}", fontsize=8)
        ax.set_xlabel(f"points (of {top})", fontsize=8)
        ax.set_ylabel("submissions", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
