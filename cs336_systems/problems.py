"""The handout's problems this repo answers: points, what each asks for, and where it lives.

One list for the grade table printed by ``make test`` (tests/grading.py), for the writeup's
map of problems to sections and tests, and for a newcomer looking for a problem in the tree.
Problems are those of CS336 assignment 2's distributed part, spring 2025 edition (section 2 and
optimizer state sharding), and the FSDP problems the 2026 edition adds; ``edition`` says which.
``make test`` writes the grade table as a results file (kind "grades") that the writeup reads.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cs336_systems.results.schema import Record

# The one source of the handout's problems, points and editions, which the grader reads too.
PROBLEMS_FILE = Path(__file__).resolve().parents[1] / "grading" / "problems.toml"
CODE, MEASURED, WRITTEN = "code", "measured", "written"  # what a problem's deliverable is


@dataclass(frozen=True)
class Problem:
    name: str  # the handout's name for it
    points: int  # the handout's
    editions: tuple[str, ...]  # "2025", "2026" or both
    deliverable: str  # CODE (graded by tests), MEASURED (a benchmark and its writeup), WRITTEN (analysis)
    where: tuple[str, ...]  # the code that answers it, from the repository root
    tested: bool  # graded by the test suite (the grade table's rows)

    @property
    def edition(self) -> str:
        """"2025", "2026" or "both"."""
        return self.editions[0] if len(self.editions) == 1 else "both"


def _load() -> tuple[Problem, ...]:
    table = tomllib.loads(PROBLEMS_FILE.read_text())["problems"]
    return tuple(Problem(name, p["points"], tuple(p["editions"]), p["deliverable"], tuple(p["where"]), p["tested"])
                 for name, p in table.items())


PROBLEMS: tuple[Problem, ...] = _load()
BY_NAME = {p.name: p for p in PROBLEMS}
TESTED_POINTS = {p.name: p.points for p in PROBLEMS if p.tested}
# What `make test` may award itself: only problems whose whole deliverable is code the tests grade.
# A measured problem's tests check its benchmark code, not the written answer that the handout
# grades, so its points are left to a person (as are a written problem's).
AUTO_GRADED_POINTS = {p.name: p.points for p in PROBLEMS if p.tested and p.deliverable == CODE}


@dataclass(frozen=True)
class GradeRecord(Record):
    """One row of the grade table ``make test`` printed."""

    KIND: ClassVar[str] = "grades"
    VERSION: ClassVar[int] = 1

    problem: str  # a Problem's name, or "beyond" for tests of our own additions
    passed: int
    total: int  # tests that ran (skipped ones are not counted)
    skipped: int
    points: float | None  # earned: the problem's points times passed / total; None for "beyond"
    possible: int | None
    files: dict[str, list[int]]  # each test file that grades it -> [passed, total]
    failed: list[str]  # test ids that failed
