"""The handout's problems, their points, and which of them the hidden-style suite grades.

Everything here is read from ``problems.toml`` beside this file, the one source that the
library's map of problems (``cs336_systems/problems.py``) reads too. A problem the suite grades
splits its points over its graded tests; the rest (benchmarks and written answers) are graded
by hand from the writeup.
"""

from __future__ import annotations

import tomllib
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
