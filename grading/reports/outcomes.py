"""The plugin's outcome lines as the harness reads them while a run goes on.

``Outcomes`` reads the pipe that only the grader's pytest holds (plugin.py), parses each JSON
line as it arrives, and decides two things the harness acts on:

* **stop early** (``stop_reason``): a submission whose every test so far failed the same way,
  slowly, across several tests of more than one problem, is stopped as a hang is (suite/conftest's
  rule stops a problem after one timeout). A fork-server escape that the confinement blocks fails
  each test just inside its time limit; without this rule it held its grading for the whole
  submission's limit (1200 s) and a JOBS=2 neighbour's share of the machine with it. A failure
  that differs between tests, or comes fast, or stays within one problem, never stops a run:
  a problem that fails does not cost another its tests.
* **interrupted** (``missing_runs``): a pytest that exits on its own before every collected test
  ran every repetition was interrupted (pytest-timeout's thread method ends the process when a
  test overruns the grader's own limit, so that no later test runs on a half-imported module);
  the harness then writes no grade: it is the grader's failure, never the student's.
"""

from __future__ import annotations

import json
import os
import re
import threading

NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")
SAME_FAILURE_TESTS = 3  # distinct tests failed the same way before a run stops
SAME_FAILURE_PROBLEMS = 2  # ... of at least this many problems
SLOW_FRACTION = 0.5  # ... each after at least this fraction of the test time limit


def failure_key(reason: str) -> str:
    """A failure's one line without its numbers (rank, step, measured values) and the requirement."""
    return NUMBER.sub("N", reason.split(" [checks:")[0]).strip()


def same_slow_failure(runs: list[dict], test_timeout_s: float) -> str | None:
    """The reason shared by every run so far, if they all failed it slowly over enough tests and
    problems (see the module's docstring); else None."""
    if not runs or any(r.get("passed") or r.get("skipped") for r in runs):
        return None
    keys = {failure_key(str(r.get("reason", ""))) for r in runs}
    slow = all(float(r.get("seconds", 0)) >= SLOW_FRACTION * test_timeout_s for r in runs)
    tests, problems = {r.get("test") for r in runs}, {r.get("problem") for r in runs}
    if len(keys) == 1 and slow and len(tests) >= SAME_FAILURE_TESTS and len(problems) >= SAME_FAILURE_PROBLEMS:
        return str(runs[0].get("reason", ""))
    return None


class Outcomes:
    """Reads the outcome pipe in a thread; ``stop`` is set once the early-stop rule holds."""

    def __init__(self, fd: int, test_timeout_s: float):
        self.entries: list[dict] = []
        self.stop = threading.Event()
        self.stop_reason = ""
        self._timeout = test_timeout_s
        self._thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        """Until pytest (the only holder of the write end) is gone."""
        pending = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._add(line)
        self._add(pending)

    def _add(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        if not isinstance(entry, dict):
            return
        self.entries.append(entry)
        if "test" in entry and not self.stop.is_set():
            reason = same_slow_failure(self.runs(), self._timeout)
            if reason is not None:
                self.stop_reason = reason
                self.stop.set()

    def runs(self) -> list[dict]:
        return [e for e in self.entries if "test" in e]

    def missing_runs(self, repeats: int) -> int:
        """Runs that collected tests should have made and that no line reports."""
        collected = [e for e in self.entries if "collected" in e]
        return max(0, len(collected) * repeats - len(self.runs()))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)
