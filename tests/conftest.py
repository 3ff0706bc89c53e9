"""Test-wide set-up: a free rendezvous port and one thread per rank for every test, the grade report,
the committed writeup rendered once per session, the session's gradings of fixtures
(tests/grading_session.py), and the end of this process's rank pools (tests/rank_pool.py)."""

from __future__ import annotations

import sys

import pytest

from cs336_systems.launch import find_free_port
from tests import grading_session
from tests.grading import GradeReport
from tests.rank_pool import close_pools


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--grades-out", default=None, metavar="PATH",
                     help="also write the grade table as a results file ('auto': this machine's results folder)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{grading_session.MARKER}(name): reads this session fixture's grading "
                                       "(tests/grading_session.py)")
    if not config.pluginmanager.has_plugin("grade-report"):
        config.pluginmanager.register(GradeReport(config.getoption("--grades-out")), "grade-report")


_GRADED_FIXTURES = pytest.StashKey[set]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_GRADED_FIXTURES] = grading_session.wanted_fixtures(items)


@pytest.fixture(scope="session")
def session_gradings(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> grading_session.SessionGradings:
    """The session's folder passes of graded fixtures: each test takes its own submission's result."""
    return grading_session.SessionGradings(tmp_path_factory.mktemp("session-gradings"),
                                           pytestconfig.stash.get(_GRADED_FIXTURES, set()))


@pytest.fixture(scope="session")
def committed_writeup(tmp_path_factory: pytest.TempPathFactory):
    """The committed results (writeup/results) rendered once per session, as `make writeup` renders
    them: the folder it was written to and what render_writeup returned. Read it; never write into it."""
    from cs336_systems.results.paths import RESULTS_ROOT
    from cs336_systems.writeup import render_writeup

    out = tmp_path_factory.mktemp("committed-writeup")
    return out, render_writeup(RESULTS_ROOT, out)


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_pools()  # this process's rank pools (tests/rank_pool.py): their ranks leave the group together


@pytest.fixture(autouse=True)
def free_rendezvous_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """Point MASTER_ADDR/MASTER_PORT at a free local port for this test.

    Ranks spawned by the test inherit these variables, so the public CS336 tests, which read
    them, run safely side by side under ``pytest -n auto``.
    """
    port = find_free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    if sys.platform.startswith("linux"):
        # All ranks are local: keep gloo on loopback whatever the hostname resolves to.
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    # pytest -n auto runs one worker per core, each spawning ranks: one thread per rank keeps a
    # 16-core machine as uncontended as a 2-core one (cpu_threads_per_rank reads this).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return port
