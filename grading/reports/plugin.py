"""pytest plugin of a grading run: repeats every test, sends each outcome to the harness.

``--grading-repeats N`` runs every test N times (ids end in ``-rep1`` … ``-repN``); the report
(report.py) scores a test only if all its repetitions passed. ``--grading-fd FD`` is the write
end of a pipe the harness holds the other end of: the plugin writes a JSON line for each
collected test (its problem, whether it is beyond the handout, the requirement its docstring
names), then one per test run (passed, the one-line reason, seconds). No rank holds that pipe,
and no file on disk carries outcomes, so a submission cannot write one.

A test that failed because an adapter is not implemented (the public stub's NotImplementedError)
is not run again: its later repetitions are skipped, and the report scores it on the one run.
"""

from __future__ import annotations

import json
import os
import re

import pytest

REPEAT_ID = re.compile(r"rep\d+")
UNIMPLEMENTED = "NotImplementedError (adapter not implemented)"  # ranks.one_line's words for the stub


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("grading")
    group.addoption("--grading-repeats", type=int, default=1, help="run every test this many times")
    group.addoption("--grading-fd", type=int, default=None, help="write every test's outcome to this descriptor")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "problem(name): the handout problem a test grades")
    config.addinivalue_line("markers", "beyond_handout: a check beyond the handout, reported for 0 points")
    config.addinivalue_line("markers", "loopback: reads the ranks' traffic: run only in the run's own network namespace")
    config.pluginmanager.register(_Recorder(config.getoption("--grading-fd")), "grading-recorder")


@pytest.fixture(autouse=True)
def grading_repetition(request):
    return getattr(request, "param", 1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    repeats = metafunc.config.getoption("--grading-repeats")
    if repeats > 1 and "grading_repetition" in metafunc.fixturenames:
        metafunc.parametrize("grading_repetition", range(1, repeats + 1), indirect=True,
                             ids=[f"rep{i}" for i in range(1, repeats + 1)])


def test_name(nodeid: str) -> str:
    """A test's id without its repetition (wherever pytest put it among the params): ``file::test[params]``."""
    if nodeid.endswith("]") and "[" in nodeid:
        base, params = nodeid[:-1].split("[", 1)
        kept = [p for p in params.split("-") if not REPEAT_ID.fullmatch(p)]
        nodeid = f"{base}[{'-'.join(kept)}]" if kept else base
    return nodeid.removeprefix("grading/suite/")


def requirement(item: pytest.Item) -> str:
    """The first paragraph of a test's docstring, on one line: what the handout asks that it checks."""
    doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def reason_of(report: pytest.TestReport) -> str:
    text = report.longreprtext.strip() if report.longrepr else ""
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = report.longrepr[2]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return ""
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return (errors[0] if errors else lines[-1]).strip().removeprefix("AssertionError: ")


class _Recorder:
    def __init__(self, fd: int | None):
        self.fd = fd
        self.problem: dict[str, str] = {}
        self.unimplemented: set[str] = set()  # tests (without repetition) whose adapter is the stub

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if test_name(item.nodeid) in self.unimplemented:
            pytest.skip("not run again: an adapter it needs is not implemented")

    def _write(self, entry: dict) -> None:
        """One JSON line, written at once: a run stopped at its time limit keeps what it graded."""
        if self.fd is not None:
            data = (json.dumps(entry) + "\n").encode()
            while data:
                data = data[os.write(self.fd, data):]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        collected = {}
        for item in items:
            marker = item.get_closest_marker("problem")
            self.problem[item.nodeid] = marker.args[0] if marker else "beyond"
            collected[test_name(item.nodeid)] = {  # repeats collapse
                "collected": test_name(item.nodeid), "problem": self.problem[item.nodeid],
                "beyond": item.get_closest_marker("beyond_handout") is not None, "requirement": requirement(item)}
        for entry in collected.values():
            self._write(entry)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and UNIMPLEMENTED in reason_of(report):
            self.unimplemented.add(test_name(report.nodeid))
        if report.when == "call" or report.failed or report.skipped:
            if report.when != "call" and report.passed:
                return
            self._write({"test": test_name(report.nodeid), "problem": self.problem.get(report.nodeid, "beyond"),
                         "passed": report.passed, "skipped": report.skipped,
                         "reason": "" if report.passed else reason_of(report),
                         "seconds": round(report.duration, 2)})
