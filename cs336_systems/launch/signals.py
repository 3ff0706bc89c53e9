"""Stopping a job cleanly: the launcher turns SIGTERM/SIGINT into an exception, ranks die with it.

What stops a run from outside is a signal: SIGTERM from ``kill``, ``scancel`` or a time limit,
SIGINT from Ctrl-C. The launcher (the process that spawned the ranks) catches both while it
waits for its ranks (:func:`raising_on_signals`), terminates them, and ends with one line,
``interrupted: ...``, and status 128 + the signal's number; nothing is written for the run it
interrupted. A rank never outlives its launcher: it asks the kernel to kill it when its parent
dies (:func:`die_with_parent`, Linux's PR_SET_PDEATHSIG), since a rank blocked inside a
collective would not notice otherwise. Ranks ignore SIGINT: Ctrl-C reaches every process of
the terminal's group, and the launcher alone decides, so no rank prints a KeyboardInterrupt.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Interrupted(Exception):
    """The run was stopped by a signal; :attr:`exit_status` is what a shell reports for it."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"received {name}" + (f"; {detail}" if detail else ""))

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextmanager
def raising_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise :class:`Interrupted` in the main thread.

    SIGINT is left alone where it is ignored (a job started in the background by a script
    ignores it, and should go on doing so). Outside the main thread this does nothing: Python
    delivers signals to the main thread only.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent(parent_pid: int) -> None:
    """Make this process die (SIGKILL) when its parent does, or now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def become_rank_process(parent_pid: int) -> None:
    """Signal dispositions of a spawned rank: die with the launcher, leave SIGINT to it."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
