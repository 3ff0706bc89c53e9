"""What course staff read first after grading a folder: per problem, how many submissions got
full, partial and no points, the most common reasons for losing them, and the distribution.

``OUT/summary.md`` and ``OUT/summary.png``. Reasons are grouped by their one line with the
numbers taken out (``rank 1, step 2: … by 0.031`` and ``rank 0, step 1: … by 0.02`` are one
reason), each counted once per submission, shown with one example.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from grading.harness import Graded

NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")
MOST_COMMON = 5


def reason_key(output: str) -> str:
    """A failure's line without the requirement it checks and without its numbers."""
    return NUMBER.sub("N", output.split(" [checks:")[0]).strip()


def write(out: Path, graded: list[Graded]) -> None:
    problems = list(dict.fromkeys(r.problem for g in graded for r in g.rows if r.points is not None))
    lines = [f"# Summary of {len(graded)} submissions", ""]
    died = [g for g in graded if g.note]
    if died:
        lines += [f"{len(died)} not graded (their job died): " + ", ".join(g.name for g in died), ""]
    lines += ["| problem | points | full | partial | none | median |", "|---|---:|---:|---:|---:|---:|"]
    scores: dict[str, list[float]] = {}
    for problem in problems:
        rows = [r for g in graded for r in g.rows if r.problem == problem and r.points is not None]
        possible = rows[0].possible
        scores[problem] = sorted(r.points for r in rows)
        full = sum(r.points >= possible for r in rows)
        none = sum(r.points == 0 for r in rows)
        median = scores[problem][len(rows) // 2]
        lines.append(f"| {problem} | {possible} | {full} | {len(rows) - full - none} | {none} | {median:g} |")
    for problem in problems:
        reasons: Counter[str] = Counter()
        example: dict[str, str] = {}
        for g in graded:
            keys = {reason_key(t.output): t.output for t in g.tests if t.problem == problem and not t.passed
                    and not t.beyond}
            reasons.update(keys.keys())
            for key, output in keys.items():
                example.setdefault(key, f"{g.name}: {output.split(' [checks:')[0]}")
        if reasons:
            lines += ["", f"## {problem}: most common reasons for lost points", "",
                      "| submissions | reason (one example) |", "|---:|---|"]
            lines += [f"| {n} | {_cell(example[key])} |" for key, n in reasons.most_common(MOST_COMMON)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    _figure(out / "summary.png", scores, {r.problem: r.possible for g in graded for r in g.rows})


def _cell(text: str) -> str:
    """A table cell: at most 300 characters, its pipes escaped."""
    return text[:300].replace("|", "\\|")


def _figure(path: Path, scores: dict[str, list[float]], possible: dict[str, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not scores:
        scores = {"no graded problem": []}
    fig, axes = plt.subplots(1, len(scores), figsize=(3.2 * len(scores), 2.6), squeeze=False)
    for ax, (problem, values) in zip(axes[0], scores.items()):
        top = possible.get(problem, 1)
        ax.hist(values, bins=min(10, max(1, len(values))), range=(0, top), color="#4c72b0")
        ax.set_title(problem.replace("_", " "), fontsize=8)
        ax.set_xlabel(f"points (of {top})", fontsize=8)
        ax.set_ylabel("submissions", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
