"""Other jobs' demand for the CPUs while a run lasts: what the load average cannot tell apart.

The 1-minute load average counts every runnable thread, the run's own among them: two ranks on
two cores, each with gloo's busy transport thread beside its compute thread, read about 2.3 on
a machine where nothing else ran. So the load average cannot say whether *other* jobs competed
with the run. :class:`OthersSampler` can: once a second it counts the threads, machine-wide,
that are runnable (or waiting in the kernel, as the load average counts them) and belong to no
process of this script's tree (``/proc``, Linux), and :func:`others_mean` is their average over
the run. It starts when :mod:`cs336_systems.results.environment` is first imported in the
script's main process (never in its ranks), so it covers the run from its start.
"""

from __future__ import annotations

import os
import sys
import threading

PROC = "/proc"
INTERVAL_S = 1.0  # one count a second: about 5 ms of this process's time each on a quiet machine


def _stat_fields(path: str) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (state first), or None if it is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def runnable_threads(proc: str = PROC) -> tuple[dict[int, int], dict[int, int]]:
    """Every process's parent, and how many of its threads are now runnable or in uninterruptible
    wait (states R and D, what the load average counts)."""
    parents: dict[int, int] = {}
    busy: dict[int, int] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        pid = int(name)
        fields = _stat_fields(f"{proc}/{name}/stat")
        if fields is None:
            continue
        parents[pid] = int(fields[1])
        try:
            tasks = os.listdir(f"{proc}/{name}/task")
        except OSError:
            continue
        states = (_stat_fields(f"{proc}/{name}/task/{tid}/stat") for tid in tasks)
        busy[pid] = sum(1 for s in states if s is not None and s[0] in ("R", "D"))
    return parents, busy


def runnable_outside(root: int, proc: str = PROC) -> int:
    """:func:`runnable_threads` of the processes that are neither ``root`` nor descended from it."""
    parents, busy = runnable_threads(proc)
    return sum(n for pid, n in busy.items() if n and not descends(pid, root, parents))


def descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    """Whether ``pid`` is ``root`` or one of its descendants, by ``parents``."""
    seen = 0
    while pid > 1 and seen < 4096:  # a cycle cannot happen; the bound keeps a torn read finite
        if pid == root:
            return True
        pid, seen = parents.get(pid, 0), seen + 1
    return False


class OthersSampler(threading.Thread):
    """Counts :func:`runnable_outside` this process every ``interval_s`` until the process ends."""

    def __init__(self, root: int | None = None, interval_s: float = INTERVAL_S, proc: str = PROC):
        super().__init__(name="others-sampler", daemon=True)
        self.root = os.getpid() if root is None else root
        self.interval_s, self.proc = interval_s, proc
        self.counts: list[int] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.counts.append(runnable_outside(self.root, self.proc))
            except OSError:  # /proc unreadable: no counts, and the load says "not sampled"
                return

    def stop(self) -> None:
        self._done.set()

    def mean(self) -> float | None:
        """The average count so far; None before the first one."""
        counts = list(self.counts)
        return sum(counts) / len(counts) if counts else None


_SAMPLER: OthersSampler | None = None


def start_sampling() -> None:
    """Start this script's sampler once, in its main process only (not in a rank it spawned, nor
    one a launcher started: those carry RANK or LOCAL_RANK), where ``/proc`` exists."""
    global _SAMPLER
    import multiprocessing

    if _SAMPLER is not None or multiprocessing.parent_process() is not None or not _a_script():
        return
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ or not os.path.isdir(f"{PROC}/self/task"):
        return
    _SAMPLER = OthersSampler()
    _SAMPLER.start()


def _a_script() -> bool:
    """Whether this process runs one of the repository's scripts (``python scripts/x.py``): only
    those write results. Never a test process: a thread there would be copied, mid-lock, into
    every process a test forks (a forked child once hung on such a lock)."""
    main = sys.argv[0] if sys.argv else ""
    return main.endswith(".py") and os.path.basename(os.path.dirname(os.path.abspath(main))) == "scripts"


def sampling() -> bool:
    """Whether this process samples other jobs' threads (a script's main process, see start_sampling)."""
    return _SAMPLER is not None


def others_mean() -> float | None:
    """Other processes' runnable threads, averaged since the sampler started; None if it did not."""
    return None if _SAMPLER is None else _SAMPLER.mean()
