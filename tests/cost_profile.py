"""What each test costs, by kind: the plugin behind ``make test-profile`` (scripts/test_profile.py).

Loaded with ``-p tests.cost_profile`` and ``CS336_TEST_PROFILE_DIR`` set, every pytest process (each
xdist worker) appends one JSON line per test to ``<dir>/<worker>.jsonl``: its wall time per phase,
the CPU time of the test's own process and of its children (ranks, subprocesses, a pool's ranks), and
what the test paid for, counted by wrapping the calls that pay for it:
* ``processes``: processes started with multiprocessing (``mp.spawn``, ``launch``: one per rank);
* ``subprocesses``: ``subprocess.Popen`` (scripts, a grader's pytest, probes);
* ``gradings``, ``folder_gradings`` and ``grading_s``: calls of ``grading.harness.grade`` (one
  submission; the first of a process grades the grader's probe too) and of ``grade_folder`` (a folder,
  each submission graded in a child), and their wall time;
* ``renders`` and ``render_s``: calls of ``render_writeup`` and their wall time;
* ``sleep_s``: seconds slept in ``time.sleep`` by the test's own process.
A session- or module-scoped fixture's cost lands on the first test that asks for it, which is
where a fixed cost shows. The counts are of this process only: a rank's own children are not seen.
"""

from __future__ import annotations

import functools
import json
import multiprocessing.process
import os
import resource
import subprocess
import time
from pathlib import Path

import psutil
import pytest

PROFILE_DIR_ENV = "CS336_TEST_PROFILE_DIR"

_counts: dict[str, float] = {}


def _add(key: str, value: float = 1.0) -> None:
    _counts[key] = _counts.get(key, 0.0) + value


def _counting(fn, count: str, seconds: str | None = None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _add(count)
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            if seconds:
                _add(seconds, time.monotonic() - start)
    return wrapper


def _install_counters() -> None:
    """Wrap the costly calls before any test module imports them by name."""
    multiprocessing.process.BaseProcess.start = _counting(multiprocessing.process.BaseProcess.start, "processes")
    popen_init = subprocess.Popen.__init__
    subprocess.Popen.__init__ = _counting(popen_init, "subprocesses")
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        _add("sleep_s", max(0.0, float(seconds)))
        real_sleep(seconds)
    time.sleep = sleep

    import grading.harness as harness
    harness.grade = _counting(harness.grade, "gradings", "grading_s")
    import grading.course.course as course
    course.grade_folder = _counting(course.grade_folder, "folder_gradings", "grading_s")
    import cs336_systems.writeup as writeup
    import cs336_systems.writeup.render as render
    counted = _counting(render.render_writeup, "renders", "render_s")
    render.render_writeup = writeup.render_writeup = counted


def _cpu() -> tuple[float, float]:
    """This process's CPU seconds, and its children's: those reaped, and those still running (a
    rank pool's ranks live across tests). A child alive at one reading and reaped by the next is
    counted once: its running total leaves the second sum as its reaped total enters the first."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    running = 0.0
    for child in psutil.Process().children():
        try:
            t = child.cpu_times()
            running += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # gone between the listing and the reading: its time is in the reaped sum next
            continue
    return me.ru_utime + me.ru_stime, reaped.ru_utime + reaped.ru_stime + running


class Profile:
    def __init__(self, folder: Path) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{worker}.jsonl"
        self.phases: dict[str, float] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        _counts.clear()
        self.phases = {}
        own, children = _cpu()
        start = time.monotonic()
        yield
        wall = time.monotonic() - start
        own_after, children_after = _cpu()
        record = {"nodeid": item.nodeid, "file": str(item.path.relative_to(item.config.rootpath)),
                  "wall_s": wall, "cpu_s": own_after - own, "children_cpu_s": children_after - children,
                  **self.phases, **_counts}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.phases[f"{report.when}_s"] = report.duration
        if report.when == "call" or report.outcome != "passed":
            self.phases.setdefault("outcome", report.outcome)


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get(PROFILE_DIR_ENV)
    if folder:
        _install_counters()
        config.pluginmanager.register(Profile(Path(folder)), "test-profile")
