"""One grading of a folder of fixtures per session: tests that grade a fixture share its result.

A test module declares each submission it grades as a :class:`Fixture` (a name, how to build its
tree, and the grading's settings) with :func:`fixture`, and marks each test that reads it with
``@pytest.mark.graded_fixture(name)`` (or the ``marks`` of its ``pytest.param``). The first test that
asks the ``session_gradings`` fixture for a result builds every fixture that the session's selected
tests read *and that has the same settings* into one folder and grades that folder once with the
grader's folder mode (``grading.course.course.grade_folder``, as ``make grade SUBMISSIONS=`` does:
one self-check, then each submission contained as when graded alone); each test then asserts on its
own submission's :class:`Graded`, ``results.json`` and ``grade.md`` under ``OUT/<name>/``.

The grader grades a folder with one set of settings (edition, problems, ``-k`` selection, limits,
repeats), so fixtures are graded in one pass per distinct setting. What a pass saves is the grader's
to decide: today each submission of a folder is graded in a child of its own (its intake, the suite's
pytest and fork server), one at a time here (``jobs=1``: the other xdist worker has the second core,
and the suite's per-test deadlines must not race a third process), so a pass costs what its gradings
did one by one (the self-check runs once per process either way); one fork server and one pytest for a whole folder would make it
one pass in fact. Every test that reads a session
grading carries ``xdist_group("session-gradings")``: one worker holds the folder, graded once per
session rather than once per worker.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from grading.course import course
from grading.harness import Graded, Limits

XDIST_GROUP = "session-gradings"
MARKER = "graded_fixture"


@dataclass(frozen=True)
class Settings:
    """What a folder pass grades with: every fixture graded in one pass shares these."""

    edition: str | None
    limits: Limits
    only: tuple[str, ...] | None = None
    select: str | None = None  # a pytest -k expression over the grader's suite
    repeats: int = 1


@dataclass(frozen=True)
class Fixture:
    name: str  # its folder in the session's inbox, and in OUT: unique in the session
    build: Callable[[Path], Path]  # makes the submission's tree inside the given folder; returns it
    settings: Settings


@dataclass(frozen=True)
class GradedFixture:
    graded: Graded
    out: Path  # OUT/<name>/: results.json, grade.md

    @property
    def results_json(self) -> Path:
        return self.out / "results.json"

    @property
    def grade_md(self) -> Path:
        return self.out / "grade.md"


FIXTURES: dict[str, Fixture] = {}


def fixture(name: str, build: Callable[[Path], Path], settings: Settings) -> str:
    """Declare a submission graded once per session; its name, for the test's marker."""
    if name in FIXTURES and FIXTURES[name] != Fixture(name, build, settings):
        raise ValueError(f"two session fixtures are named {name!r}: the names are folders in one inbox")
    FIXTURES[name] = Fixture(name, build, settings)
    return name


def graded_fixture(name: str) -> list[pytest.MarkDecorator]:
    """The marks of a test that reads fixture ``name``: its marker, and the workers' shared group."""
    return [getattr(pytest.mark, MARKER)(name), pytest.mark.xdist_group(XDIST_GROUP)]


class SessionGradings:
    """The folder passes of one session, made as they are first needed."""

    def __init__(self, root: Path, wanted: set[str]) -> None:
        self.root, self.wanted = root, wanted
        self.results: dict[str, GradedFixture] = {}
        self.passes: list[tuple[Settings, list[str], float]] = []  # what each pass graded, and its seconds

    def result(self, name: str) -> GradedFixture:
        if name not in FIXTURES:
            raise KeyError(f"no session fixture {name!r}: declare it with tests.grading_session.fixture()")
        if name not in self.results:
            self._grade(FIXTURES[name].settings, name)
        return self.results[name]

    def _grade(self, settings: Settings, asked: str) -> None:
        names = sorted({asked} | {n for n in self.wanted if FIXTURES[n].settings == settings} - set(self.results))
        folder = Path(tempfile.mkdtemp(prefix="pass-", dir=self.root))
        inbox, out = folder / "inbox", folder / "out"
        inbox.mkdir(mode=0o700)
        for name in names:
            built = FIXTURES[name].build(folder / "build" / name)
            built.rename(inbox / name)
        s = settings
        graded = course.grade_folder(inbox, out, s.repeats, s.edition, s.limits, jobs=1, only=s.only, select=s.select,
                              quiet=True)
        by_name = {g.name: g for g in graded}
        for name in names:
            self.results[name] = GradedFixture(by_name[name], out / name)
        self.passes.append((settings, names, sum(g.seconds for g in graded)))


def wanted_fixtures(items: list[pytest.Item]) -> set[str]:
    """The fixtures the selected tests read (from their markers)."""
    return {mark.args[0] for item in items for mark in item.iter_markers(MARKER)}
