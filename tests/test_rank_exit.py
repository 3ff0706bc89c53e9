"""Finished ranks end with status 0 (issue 27), and nothing is left for gloo to destroy late.

Ranks that had finished their work used to die at interpreter exit with SIGABRT ("terminate
called without an active exception") a few runs in ten, more often on a loaded machine:
torch pinned the default group until exit, and a gloo worker thread that still had a finished
collective to drop during finalization aborted the process (cs336_systems/launch/lifetime.py).

* The cause, checked without luck: after each wrapper's ``release()`` and ``teardown()``, no
  gloo worker thread is left in the rank, so there is nothing for finalization to abort on
  (before the fix, both of the group's workers were left after every wrapper).
* The symptom: the 2-rank job of the issue (exit_job.py: three steps with one of our wrappers,
  in turn) started ``EXIT_RUNS`` times in a row through this repo's launcher and
  through ``torch.multiprocessing.spawn`` with tests/common.py's teardown, on a quiet machine
  and beside two busy processes; every run must end with status 0. Before the fix, 4 of 30
  such jobs with per-parameter DDP died this way here.

A spawned rank starts a fresh interpreter that imports torch and, with the first optimizer,
torch._dynamo: about 2.5 s of CPU, so a job costs 3-10 s on 2 shared cores. ``make test`` runs 2
jobs per case, quiet only: its other worker keeps the 2 cores loaded already, and two spinners
beside it took 2 cores for 16 s per case from every other test (about a minute in all).
``EXIT_RUNS=20`` is the acceptance setting, with the spinners (80 jobs: 22 min on that machine,
every one status 0).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch.multiprocessing as mp

from cs336_systems.launch import find_free_port, launch
from tests.exit_job import WRAPPERS, launched_job, spawned_job, workers_after_teardown

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("rank-exit")]

RUNS = int(os.environ.get("EXIT_RUNS", "2"))
WORLD_SIZE = 2


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU for the duration (what a loaded machine does to
    the ranks: their gloo worker threads wait for a core)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


@pytest.mark.timeout(240)
def test_teardown_leaves_no_gloo_worker_whatever_the_wrapper():
    counts = launch(workers_after_teardown, WORLD_SIZE, backend="gloo", device_type="cpu")
    assert counts == [dict.fromkeys(WRAPPERS, 0)] * WORLD_SIZE


def _run_launched(name: str) -> None:
    launch(launched_job, WORLD_SIZE, (name,), backend="gloo", device_type="cpu", timeout_s=60)


def _run_spawned(name: str) -> None:
    mp.spawn(spawned_job, args=(WORLD_SIZE, find_free_port(), name), nprocs=WORLD_SIZE, join=True)


PATHS = {"launcher": _run_launched, "mp.spawn": _run_spawned}


@pytest.mark.timeout(120 + 45 * RUNS)  # a loaded 2-core machine: up to ~30 s a job
@pytest.mark.parametrize("busy", [0, 2] if "EXIT_RUNS" in os.environ else [0],
                         ids=["quiet", "two-busy-processes"] if "EXIT_RUNS" in os.environ else ["quiet"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_issue_job_ends_with_status_0_every_time(path, busy):
    run = PATHS[path]
    wrappers = itertools.cycle(WRAPPERS)
    failures = []
    start = time.monotonic()
    with busy_processes(busy):
        for i in range(RUNS):
            name = next(wrappers)
            try:
                run(name)
            except Exception as e:  # a rank that died at exit, or any other failure: counted
                failures.append(f"run {i} ({name}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    elapsed = time.monotonic() - start
    assert failures == [], f"{len(failures)} of {RUNS} runs failed in {elapsed:.0f} s:\n" + "\n".join(failures)
