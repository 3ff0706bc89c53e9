"""The handout's problems, their points, and which of them the hidden-style suite grades.

Everything here is read from ``problems.toml`` beside this file, the one source that the
library's map of problems (``cs336_systems/problems.py``) reads too. A problem the suite grades
splits its points over its graded tests by its rubric (each test's share, and a cap for a
solution that misses what the problem is named for); the rest (benchmarks and written answers)
are graded by hand from the writeup.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

DATA = Path(__file__).resolve().parent / "problems.toml"
_TABLE = tomllib.loads(DATA.read_text())

# name -> (points, editions it appears in)
POINTS: dict[str, tuple[int, tuple[str, ...]]] = {
    name: (p["points"], tuple(p["editions"])) for name, p in _TABLE["problems"].items()}

# The adapters each edition's public tests/adapters.py declares (the distributed part).
EDITION_ADAPTERS: dict[str, tuple[str, ...]] = {e: tuple(t["adapters"]) for e, t in _TABLE["editions"].items()}

# The problems the suite grades, per edition; "both" is this repository, which answers both.
GRADED: dict[str, tuple[str, ...]] = {e: tuple(t["graded"]) for e, t in _TABLE["editions"].items()}
GRADED["both"] = tuple(p for p in POINTS if p in GRADED["2025"] + GRADED["2026"])
EDITIONS = ("2025", "2026", "both")


def in_edition(problem: str, edition: str) -> bool:
    return edition == "both" or edition in POINTS[problem][1]


def hand_graded(edition: str) -> list[str]:
    """The edition's problems the suite does not grade: benchmarks and written answers."""
    return [p for p in POINTS if in_edition(p, edition) and p not in GRADED[edition]]


@dataclass(frozen=True)
class Rubric:
    """How a problem's points are split over its graded tests, and the cap (problems.toml)."""

    shares: dict[str, float]  # test function -> its points, split evenly over its parameters
    point: tuple[str, ...]  # the tests of what the problem is named for (their findings end with named_for)
    cap: Fraction  # the most a solution that fails a point test earns, as a fraction of the points

    def capped_points(self, points: int) -> float:
        return round(float(points * self.cap), 4)


def _rubric(problem: str, table: dict) -> Rubric:
    rubric = Rubric(dict(table["shares"]), tuple(table["point"]), Fraction(table["cap"]))
    total = round(sum(rubric.shares.values()), 6)
    if total != POINTS[problem][0] or not set(rubric.point) <= set(rubric.shares):
        raise ValueError(f"problems.toml: the rubric of {problem} gives {total} of {POINTS[problem][0]} points, "
                         f"or names a point test ({rubric.point}) without a share")
    return rubric


RUBRIC: dict[str, Rubric] = {p: _rubric(p, t) for p, t in _TABLE.get("rubric", {}).items()}


def named_for(problem: str) -> str:
    """The words a point test's finding ends with when a solution misses what ``problem`` is named
    for (not sharded, not overlapped): they tell a TA which finding is the point. The cap does not
    read them: a point test that fails for any reason caps its problem (report.apply_cap)."""
    return f"(what {problem} is named for)"


def test_function(test: str) -> str:
    """``test_fsdp.py::test_adamw[2]`` -> ``test_adamw``."""
    return test.rsplit("::", 1)[-1].split("[", 1)[0]
